"""EAGLE-3 head training (rlspec.draft.eagle3, rlspec.draft.train): the training-time-test unroll
is exactly the drafter vLLM runs step by step, the checkpoint round-trips in vLLM's format, the
objective and its acceptance proxy behave, and the offline trainer writes a head vLLM serves."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TEST_EXPERIMENT

POLICY = str(ROOT / "rlspec" / "assets" / "tiny" / "policy")
EAGLE3 = str(ROOT / "rlspec" / "assets" / "tiny" / "eagle3")
DRAFT = str(ROOT / "rlspec" / "assets" / "tiny" / "draft")


@pytest.fixture(scope="module")
def target():
    from rlspec.models import load_causal_lm
    return load_causal_lm(POLICY).eval()


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    """A random head whose weights are scaled up so attention is far from uniform: a mask error
    then changes the outputs by far more than float noise."""
    from rlspec.draft.eagle3 import Eagle3Head
    from rlspec.draft.heads import init_eagle3_head

    d = init_eagle3_head(POLICY, str(tmp_path_factory.mktemp("h") / "head"), seed=3)
    h = Eagle3Head.from_checkpoint(d, target.get_input_embeddings().weight)
    with torch.no_grad():
        for name, p in h.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(10)
    return h


def _incremental(head, tokens, aux, t, steps):
    """vLLM's drafter for one anchor t, written step by step with a KV cache: step 0 runs over
    positions 0..t (causal) and keeps its keys; step j appends one key at position t+j."""
    rep = head.n // head.kv
    T = t + 1
    q, k, v, res = head._qkv(tokens[None, 1: T + 1], head.fc(aux[None, :T]), torch.arange(T)[None])
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    att = torch.softmax((q @ k.transpose(-1, -2)) * head.d ** -0.5
                        + torch.full((T, T), float("-inf")).triu(1), -1) @ v
    logits, pre = head._finish(att, res)
    out, hidden = [logits[0, t]], pre[:, t: t + 1]
    for j in range(1, steps):
        q, kj, vj, res = head._qkv(tokens[None, t + 1 + j: t + 2 + j], hidden, torch.tensor([[t + j]]))
        k = torch.cat([k, kj.repeat_interleave(rep, 1)], 2)
        v = torch.cat([v, vj.repeat_interleave(rep, 1)], 2)
        att = torch.softmax((q @ k.transpose(-1, -2)) * head.d ** -0.5, -1) @ v
        logits, hidden = head._finish(att, res)
        out.append(logits[0, 0])
    return out


def test_unrolled_training_equals_step_by_step_drafting(target, head):
    from rlspec.draft.capture import target_features

    torch.manual_seed(0)
    ids = torch.randint(1, 282, (2, 24))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 17:] = False  # right padding must not leak into the real positions
    f = target_features(target, ids, mask.long(), [1, 2, 3], topk=5)
    with torch.no_grad():
        unrolled = head.unrolled(ids, f.aux_hidden, mask, 3)
        for b, length in ((0, 24), (1, 17)):
            for t in (0, 5, length - 4):
                ref = _incremental(head, ids[b, :length], f.aux_hidden[b, :length], t, 3)
                for j in range(3):
                    torch.testing.assert_close(unrolled[j][b, t], ref[j], rtol=1e-4, atol=1e-4)
        # and it is not vacuous: a different anchor's drafts differ
        assert not torch.allclose(unrolled[2][0, 5], unrolled[2][0, 6], atol=1e-2)


def test_checkpoint_round_trip_is_exact(target, head, tmp_path):
    from safetensors.torch import load_file

    from rlspec.draft.eagle3 import Eagle3Head

    out = head.save(tmp_path / "h", tokenizer_dir=POLICY)
    saved = load_file(f"{out}/model.safetensors")
    original = load_file(str(next(ROOT.glob("rlspec/assets/tiny/policy/model.safetensors"))))
    assert "lm_head.weight" in saved and "midlayer.self_attn.q_proj.weight" in saved
    assert all("embed" not in k for k in saved)  # vLLM shares the target's embedding
    assert saved["fc.weight"].dtype == original["model.embed_tokens.weight"].dtype  # the target's dtype
    back = Eagle3Head.from_checkpoint(out, target.get_input_embeddings().weight)
    assert all(torch.equal(back.vllm_state_dict()[k], v) for k, v in saved.items())
    assert (tmp_path / "h" / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="unexpected EAGLE-3 weights"):
        back.load_vllm_state_dict({**saved, "midlayer.extra.weight": saved["norm.weight"]})


def test_ttt_loss_masks_and_proxy():
    from rlspec.draft.eagle3 import acceptance_length_proxy, ttt_loss

    B, T, V, K = 2, 8, 11, 3
    ids = torch.stack([torch.randperm(V)[:K] for _ in range(B * T)]).view(B, T, K)  # distinct per position
    logp = torch.randn(B, T, K).log_softmax(-1).sort(-1, descending=True).values  # as topk returns them
    # a draft that puts all its mass on the target's top-K with the target's own probabilities
    exact = torch.full((B, T, V), -1e9)
    exact.scatter_(-1, ids, logp)
    logits = [torch.cat([exact[:, j + 1:], exact[:, -1:].expand(B, j + 1, V)], 1) for j in range(2)]
    loss, stats = ttt_loss(logits, ids, logp, torch.tensor([3, 3]), torch.tensor([8, 6]))
    entropy = -(logp.exp() * logp).sum(-1)
    assert stats["accept"] == pytest.approx([1.0, 1.0]) and stats["top1"] == pytest.approx([1.0, 1.0])
    # step 0 counts positions u = 3..length-2: rows 0 (u=3..6) and 1 (u=3..4)
    want0 = torch.cat([entropy[0, 3:7], entropy[1, 3:5]]).mean()
    assert stats["loss"][0] == pytest.approx(want0.item(), rel=1e-5)
    assert loss.item() == pytest.approx(stats["loss"][0] + 0.8 * stats["loss"][1], rel=1e-5)
    assert acceptance_length_proxy([0.5, 0.5, 0.5]) == pytest.approx(1.875)


def test_config_errors_name_the_key(tmp_path):
    from rlspec.config import ConfigError, DraftConfig, DraftTrainConfig
    from rlspec.draft.train import validate

    with pytest.raises(ConfigError, match="draft.corpus"):
        validate(DraftTrainConfig(draft=DraftConfig(corpus="web")))
    with pytest.raises(ConfigError, match="draft.text_file"):
        validate(DraftTrainConfig(draft=DraftConfig(corpus="text", text_file=str(tmp_path / "missing.txt"))))
    with pytest.raises(ConfigError, match="draft.ttt_steps"):
        validate(DraftTrainConfig(draft=DraftConfig(ttt_steps=0)))
    with pytest.raises(ConfigError, match="draft.init=null"):
        validate(DraftTrainConfig(draft=DraftConfig(kind="draft_model")))
    with pytest.raises(ConfigError, match="draft.kind"):
        validate(DraftTrainConfig(draft=DraftConfig(kind="medusa")))
    with pytest.raises(ConfigError, match="draft.steps"):
        validate(DraftTrainConfig(draft=DraftConfig(steps=-1)))


def test_draft_model_vocab_must_match_the_target(tmp_path):
    from rlspec.config import ConfigError
    from rlspec.draft.train import check_draft_vocab

    cfg = json.loads((Path(DRAFT) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vocab_size": 300}))
    check_draft_vocab(DRAFT, POLICY)
    with pytest.raises(ConfigError, match="vocabulary of 300 tokens, the target's has 282"):
        check_draft_vocab(str(tmp_path), POLICY)


@pytest.mark.slow  # the default suite stays under 30 minutes on 2 cores
def test_cli_trains_a_head_that_vllm_serves(tmp_path):
    """A short real run: the target regenerates the corpus in a vLLM actor, the head trains, and
    vLLM loads the written head and drafts with it (acceptance measured there)."""
    out = tmp_path / "head"
    r = subprocess.run([sys.executable, "-m", "rlspec.draft.train", "draft.steps=40", "draft.num_prompts=128",
                        "draft.val_prompts=16", "draft.eval_every=20", "logging.wandb_mode=disabled",
                        "logging.progress_bar=false", f"draft.out_dir={out}", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    logd = json.loads((out / "train_log.json").read_text())
    first, last = logd["evals"][0], logd["evals"][-1]
    assert [e["step"] for e in logd["evals"]] == [0, 20, 40]
    assert sum(last["loss"]) < sum(first["loss"]) - 1.0
    assert last["acceptance_length_proxy"] > first["acceptance_length_proxy"]
    v = logd["vllm"]
    assert v["k"] == 3 and v["drafts"] > 0 and len(v["acceptance_per_pos"]) == 3
    assert (out / "curves.png").exists() and (out / "config.json").exists()


@pytest.mark.slow  # the default suite stays under 30 minutes on 2 cores
def test_cli_trains_a_draft_model_that_vllm_serves(tmp_path):
    """The second kind: a small draft model (the tiny draft's architecture, freshly initialised so
    there is something to learn) trained on the target's regenerated responses, written in its
    initial dtype with the target's tokenizer, and served by vLLM as draft_model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fresh = tmp_path / "fresh"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DRAFT)).save_pretrained(fresh)
    out = tmp_path / "draft"
    r = subprocess.run([sys.executable, "-m", "rlspec.draft.train", "draft=draft_model", f"draft.init={fresh}",
                        "draft.steps=60", "draft.lr=3e-3", "draft.warmup_steps=10",
                        "draft.num_prompts=128", "draft.val_prompts=16", "draft.eval_every=30",
                        "logging.wandb_mode=disabled", "logging.progress_bar=false", f"draft.out_dir={out}",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    logd = json.loads((out / "train_log.json").read_text())
    first, last = logd["evals"][0], logd["evals"][-1]
    assert logd["kind"] == "draft_model" and [e["step"] for e in logd["evals"]] == [0, 30, 60]
    assert len(last["accept"]) == 1 and last["loss"][0] < first["loss"][0] - 1.0
    assert last["acceptance_length_proxy"] > first["acceptance_length_proxy"] + 0.5
    v = logd["vllm"]
    assert v["k"] == 3 and v["drafts"] > 0 and len(v["acceptance_per_pos"]) == 3 and v["acceptance_length"] > 1.0
    saved = json.loads((out / "config.json").read_text())
    assert (saved["dtype"] == json.loads((fresh / "config.json").read_text())["dtype"] and saved["vocab_size"] == 282
            and (out / "tokenizer.json").exists())


def test_cli_refuses_a_bad_key_and_a_missing_model(tmp_path):
    r = subprocess.run([sys.executable, "-m", "rlspec.draft.train", "model.path=/nonexistent/ckpt",
                        f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "model.path='/nonexistent/ckpt'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "rlspec.draft.train", "draft.stepz=3", f"hydra.run.dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "stepz" in r.stderr


def test_ttt_loss_over_a_smaller_draft_vocabulary_restricts_and_renormalises():
    """A head over 5 of 11 target tokens: the target's top-K is restricted to them and
    renormalised; a position whose top-K has none of them does not count."""
    from rlspec.draft.eagle3 import ttt_loss

    V, Vd = 11, 5
    keep = torch.tensor([1, 3, 4, 7, 9])
    draft_of_target = torch.full((V,), -1)
    draft_of_target[keep] = torch.arange(Vd)
    ids = torch.tensor([[[3, 2, 9], [5, 6, 8], [7, 1, 0], [0, 0, 0]]])     # [1, T=4, K=3]
    logp = torch.tensor([[[-0.5, -1.0, -2.0], [-0.2, -1.5, -3.0], [-0.1, -2.5, -4.0], [0.0, 0.0, 0.0]]])
    logits = [torch.zeros(1, 4, Vd)]                                         # uniform draft over 5 tokens
    loss, stats = ttt_loss(logits, ids, logp, torch.tensor([0]), torch.tensor([4]),
                           draft_of_target=draft_of_target)
    # step 0 counts u = 1..2: u=1 ([5, 6, 8]) has no draft token, so only u=2 ([7, 1, 0]) counts;
    # its in-vocabulary mass (7 and 1) is renormalised; against a uniform draft the loss is log 5
    assert stats["loss"][0] == pytest.approx(torch.log(torch.tensor(5.0)).item(), rel=1e-6)
    p = logp[0, 2, :2].softmax(-1)
    assert stats["accept"][0] == pytest.approx(torch.minimum(p, torch.full((2,), 0.2)).sum().item(), rel=1e-6)


def test_a_head_in_the_public_format_loads_as_written(target, tmp_path):
    """A 4x smaller draft vocabulary with d2t/t2d, .bin weights, a top-level rope_theta and no
    layer ids: read back into the same weights and maps, EAGLE-3's default layers, the same
    rope base, and saved again with the maps as integers."""
    from rlspec.draft.eagle3 import Eagle3Head
    from rlspec.draft.heads import eagle3_aux_layer_ids, init_eagle3_head, to_public_format

    V = target.config.vocab_size
    vocab = list(range(0, V, 4))
    src = init_eagle3_head(POLICY, str(tmp_path / "h"), seed=1, draft_vocab=vocab)
    pub = to_public_format(src, str(tmp_path / "public"), layer_ids=False)
    assert not (tmp_path / "public" / "model.safetensors").exists()
    assert "rope_parameters" not in json.loads((tmp_path / "public" / "config.json").read_text())
    embed = target.get_input_embeddings().weight
    a = Eagle3Head.from_checkpoint(src, embed)
    b = Eagle3Head.from_checkpoint(pub, embed, target.config.num_hidden_layers)
    assert b.config["eagle_aux_hidden_state_layer_ids"] == list(eagle3_aux_layer_ids(4)) == \
        a.config["eagle_aux_hidden_state_layer_ids"]
    assert b.theta == a.theta and b.lm_head.weight.shape == (len(vocab), embed.shape[1])
    sa, sb = a.vllm_state_dict(), b.vllm_state_dict()
    assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert sb["d2t"].dtype == torch.long and sb["t2d"].dtype == torch.bool and int(sb["t2d"].sum()) == len(vocab)
    m = b.draft_of_target()
    assert m[vocab].tolist() == list(range(len(vocab))) and int((m >= 0).sum()) == len(vocab)
    with pytest.raises(ValueError, match="no eagle_aux_hidden_state_layer_ids"):
        Eagle3Head.from_checkpoint(pub, embed)


def test_check_draft_takes_a_public_head_config_against_qwen3_8b(tmp_path):
    """config.json as the public Qwen3-8B EAGLE-3 head ships it (32,000-token draft vocabulary,
    top-level rope_theta, no layer ids) passes check_draft against Qwen3-8B's config; a head for
    another vocabulary or reading layers the target lacks is refused naming the key."""
    from rlspec.config import ConfigError, SpeculationConfig
    from rlspec.speculation.checks import check_draft

    head = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 1, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "vocab_size": 151936, "draft_vocab_size": 32000, "torch_dtype": "bfloat16",
            "max_position_embeddings": 40960, "tie_word_embeddings": False}
    qwen3_8b = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 36,
                "vocab_size": 151936, "num_attention_heads": 32, "num_key_value_heads": 8}
    for name, cfg in (("head", head), ("target", qwen3_8b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    spec = SpeculationConfig(method="eagle3", num_speculative_tokens=3)
    check_draft(spec, str(tmp_path / "target"), str(tmp_path / "head"))
    for bad, match in (({"vocab_size": 152064}, "vocabulary of 152064 tokens"),
                       ({"eagle_aux_hidden_state_layer_ids": [2, 18, 36]}, r"reads target layers \[2, 18, 36\]")):
        (tmp_path / "head" / "config.json").write_text(json.dumps({**head, **bad}))
        with pytest.raises(ConfigError, match=f"^speculation.model: .*{match}"):
            check_draft(spec, str(tmp_path / "target"), str(tmp_path / "head"))


def test_the_draft_vocabulary_is_the_responses_most_frequent_tokens():
    from rlspec.draft.train import Sequence, frequent_tokens

    seqs = [Sequence([9, 9, 5, 2, 2, 2, 7], 2), Sequence([9, 5, 2, 7, 7], 1)]   # responses: ids[loss_from+1:]
    assert frequent_tokens(seqs, 2, 12) == [2, 7]                                 # 2 x4, 7 x3
    assert frequent_tokens(seqs, 4, 12) == [2, 5, 7, 9]                           # then the prompts' 9 (x3) and 5 (x2)
    assert frequent_tokens(seqs, 6, 12) == [0, 1, 2, 5, 7, 9]                     # then the lowest ids left
    assert frequent_tokens(seqs, 99, 12) == list(range(12))


@pytest.mark.slow
def test_a_public_format_head_with_a_smaller_vocabulary_trains_serves_and_adapts(tmp_path):
    """Offline training builds a 70-token draft vocabulary (about a quarter of the tiny target's
    282) from the target's responses; the head, rewritten as public heads ship, serves in vLLM
    and adapts online through two RL steps (its maps pushed with it). About 4 minutes."""
    from rlspec.draft.heads import to_public_format

    out = tmp_path / "head"
    r = subprocess.run([sys.executable, "-m", "rlspec.draft.train", "draft.draft_vocab_size=70", "draft.steps=60",
                        "draft.num_prompts=128", "draft.val_prompts=16", "draft.eval_every=60",
                        "logging.wandb_mode=disabled", "logging.progress_bar=false", f"draft.out_dir={out}",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 70
    assert json.loads((out / "train_log.json").read_text())["vllm"]["acceptance_length"] > 1.5
    pub = to_public_format(str(out), str(tmp_path / "public"))
    run = tmp_path / "rl"
    r = subprocess.run([sys.executable, "-m", "rlspec.train", TEST_EXPERIMENT, "speculation=eagle3",
                        f"speculation.model={pub}",
                        "speculation.online.enabled=true", "trainer.max_steps=2", f"hydra.run.dir={run}",
                        "generation.num_prompts_per_step=8", "generation.num_generations_per_prompt=4",
                        "trainer.micro_batch_size=8", "data.val.num_rows=32", "logging.wandb_mode=disabled",
                        "logging.progress_bar=false"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert s["acceptance_length"] > 1.5
    assert [x["extra"]["draft/pushed"] for x in s["records"]] == [1.0, 1.0]
