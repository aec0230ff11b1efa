"""DraftTrainer: online adaptation of an EAGLE-3 head during RL. It owns the head, its optimizer
and the bounded feature cache the LogprobWorkers fill; the policy's tensors never reach it except
as detached, compact features, so no gradient flows from the draft into the policy."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from rlspec.config import GenerationConfig, SpeculationConfig
from rlspec.draft.cache import CachedSequence, FeatureCache
from rlspec.draft.eagle3 import Eagle3Head, acceptance_length_proxy, apply_grads, ttt_counts, ttt_loss
from rlspec.models import ModelPaths, local_device, release_cached_memory


def load_embedding(target_dir: str) -> torch.Tensor:
    """The target's input embedding [V, H], read from its safetensors (one file or sharded)."""
    from safetensors import safe_open

    d, key = Path(target_dir), "model.embed_tokens.weight"
    index = d / "model.safetensors.index.json"
    name = json.loads(index.read_text())["weight_map"][key] if index.exists() else "model.safetensors"
    with safe_open(str(d / name), framework="pt") as f:
        return f.get_tensor(key).float()


def pad_labels(items: list[CachedSequence]):
    """What the loss counts by, of cached sequences: (length, loss_from, topk_ids right-padded)."""
    T, B, K = max(len(s.ids) for s in items), len(items), items[0].topk_ids.shape[-1]
    tid = torch.zeros(B, T, K, dtype=torch.long)
    for i, s in enumerate(items):
        tid[i, :len(s.ids)] = s.topk_ids
    return torch.tensor([len(s.ids) for s in items]), torch.tensor([s.loss_from for s in items]), tid


def pad_batch(items: list[CachedSequence]):
    """Cached sequences -> right-padded (ids, mask, length, loss_from, aux, topk_ids, topk_logp,
    start: each row's first position in its rollout)."""
    length, loss_from, tid = pad_labels(items)
    T, B, A = int(length.max()), len(items), items[0].aux_hidden.shape[-1]
    ids, aux, tlp = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, A), torch.zeros(B, T, tid.shape[-1])
    for i, s in enumerate(items):
        n = len(s.ids)
        ids[i, :n], aux[i, :n], tlp[i, :n] = s.ids, s.aux_hidden.float(), s.topk_logp.float()
    mask = torch.arange(T)[None] < length[:, None]
    return ids, mask, length, loss_from, aux, tid, tlp, torch.tensor([s.start for s in items])


class DraftTrainer:
    def __init__(self, *, paths: ModelPaths, speculation: SpeculationConfig, generation: GenerationConfig,
                 seed: int, threads: int, device: str | None = None):
        """Trains the head in paths.draft for the k the engine drafts (its TTT steps), on the
        rollouts' temperature (the captured labels are at it too). device: where it trains (None:
        the one its placement gives it); its feature cache stays on the host."""
        torch.set_num_threads(threads)
        self.device = torch.device(device) if device else local_device()
        torch.manual_seed(seed)
        self.o, self.ttt_steps = speculation.online, speculation.k_max
        self.temperature = generation.temperature
        self.engine_dtype = getattr(torch, generation.dtype)  # vLLM's draft computes in the target's dtype
        layers = json.loads((Path(paths.model) / "config.json").read_text())["num_hidden_layers"]
        self.head = Eagle3Head.from_checkpoint(paths.draft, load_embedding(paths.model), layers).to(self.device)
        self.draft_of_target = self.head.draft_of_target()  # a smaller draft vocabulary's map (or None)
        self.layer_ids = list(self.head.config["eagle_aux_hidden_state_layer_ids"])
        self.opt = torch.optim.AdamW(self.head.parameters(), lr=self.o.lr)
        self.cache = FeatureCache(self.o.cache_mb << 20, self.o.max_positions, seed)
        self.rng = random.Random(seed)
        self.steps = 0
        self.newest_version: int | None = None  # newest policy version among the data trained on

    def capture_spec(self) -> dict:
        return {"layer_ids": self.layer_ids, "topk": self.o.topk}

    def add(self, *feature_lists: list[dict]) -> int:
        """Features from every LogprobWorker (lists of micro-batches) into the cache; returns its size."""
        for fl in feature_lists:
            for f in fl:
                self.cache.add_batch(f["ids"], f["mask"], f["aux_hidden"], f["topk_ids"], f["topk_logp"],
                                     f["loss_from"], f["policy_version"])
        return len(self.cache)

    def update(self, n_steps: int, *feature_lists: list[dict]) -> dict:
        """One RL step's work: cache the new features, then train n steps."""
        self.add(*feature_lists)
        return self.train(n_steps)

    def train(self, n_steps: int) -> dict:
        """n optimizer steps on batches drawn from the cache; the mean loss and acceptance proxy."""
        if not len(self.cache):
            return {}
        losses, accepts = [], []
        self.head.train()
        for _ in range(n_steps):
            items = self.cache.sample(self.o.batch_size, self.rng)
            loss, accept = self._accumulate(items)
            apply_grads(self.opt, grad_clip=1.0)
            self.steps += 1
            losses.append(loss)
            accepts.append(accept)
            v = max(s.policy_version for s in items)
            self.newest_version = v if self.newest_version is None else max(self.newest_version, v)
        release_cached_memory(self.device)
        mean_accept = [sum(a[j] for a in accepts) / len(accepts) for j in range(min(map(len, accepts)))]
        return {"loss": sum(losses) / len(losses), "accept_proxy": acceptance_length_proxy(mean_accept),
                "cache_sequences": len(self.cache), "cache_mb": self.cache.bytes / 2**20,
                "cache_evicted": self.cache.evicted, "cache_cropped": self.cache.cropped,
                "optimizer_steps": self.steps,
                "newest_version": self.newest_version}

    def _accumulate(self, items: list[CachedSequence]) -> tuple[float, list[float]]:
        """The batch's gradient, accumulated over micro-batches of speculation.online.micro_batch_size
        rows (0: the whole batch) sorted by length, so each pads to its own longest row; each step's
        loss is divided by the whole batch's count, so the sum is the whole batch's loss. Returns
        the loss and the per-step acceptance proxy."""
        self.opt.zero_grad(set_to_none=True)
        items = sorted(items, key=lambda s: len(s.ids))
        dot = None if self.draft_of_target is None else self.draft_of_target.cpu()
        length, loss_from, tid = pad_labels(items)  # the whole batch's counts, without its features
        counts = ttt_counts(tid, loss_from, length, self.ttt_steps, dot)
        mb = self.o.micro_batch_size or len(items)
        loss, accept = 0.0, []
        for i in range(0, len(items), mb):
            ids, mask, length, loss_from, aux, tid, tlp, start = (t.to(self.device) for t in pad_batch(items[i:i + mb]))
            logits = self.head.unrolled(ids, aux, mask, self.ttt_steps, start)
            part, stats = ttt_loss(logits, tid, tlp, loss_from, length, self.o.loss_decay, self.temperature,
                                   self.draft_of_target, denominators=counts)
            part.backward()
            loss += part.item()
            accept = [a + b for a, b in zip(accept, stats["accept"])] if accept else stats["accept"]
        return loss, accept

    def weights(self) -> dict[str, torch.Tensor]:
        """The head under vLLM's checkpoint names in the engines' dtype, for RefitReceiver.refit_tensors."""
        return {k: v.cpu() for k, v in self.head.vllm_state_dict(self.engine_dtype).items()}

    def save(self, path: str) -> None:
        torch.save({"head": self.head.state_dict(), "opt": self.opt.state_dict(), "steps": self.steps,
                    "newest_version": self.newest_version, "rng": self.rng.getstate()}, path)

    def load(self, path: str) -> None:
        s = torch.load(path, map_location="cpu", weights_only=False)
        self.head.load_state_dict(s["head"])
        self.opt.load_state_dict(s["opt"])
        self.steps, self.newest_version = s["steps"], s["newest_version"]
        self.rng.setstate(s["rng"])

    def ping(self) -> int:
        return self.steps
