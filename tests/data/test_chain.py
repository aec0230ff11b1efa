"""The reasoning-length task (rlspec/data/synthetic_chain.py): its working is right without slips
and consistent with them, the math reward scores it (0 for unfinished or malformed answers), its
lengths have the long tail the task exists for, and its splits are disjoint and reproducible."""
import random

from conftest import compose
from rlspec.data.synthetic_chain import Chain, chain_solution, is_heldout_chain, make_chains, term_weights
from rlspec.rewards.math import math_reward

CHAIN = dict(min_digits=1, max_digits=2, max_terms=8, tail=1.5)


def test_working_is_right_without_slips_and_carries_a_slip_to_the_end():
    c = Chain((47, 85, 9))
    text = chain_solution(c)
    assert text == "47+85: 7+5=12, 4+8+1=13, so 132. 132+9: 2+9=11, 3+0+1=4, 1+0=1, so 141. Answer: 141"
    assert math_reward(text, c.answer) == 1.0
    slipped = chain_solution(c, slip_prob=1.0, rng=random.Random(0))
    assert slipped == "47+85: 7+5=12, 4+8=12, so 122. 122+9: 2+9=11, 2+0=2, 1+0=1, so 121. Answer: 121"
    assert math_reward(slipped, c.answer) == 0.0


def test_unfinished_or_malformed_answers_score_zero():
    c = Chain((47, 85, 9))
    text = chain_solution(c)
    assert math_reward(text[: text.index(" Answer")], c.answer) == 0.0   # cut off before the answer
    assert math_reward(text.replace("Answer: 141", "Answer: one hundred"), c.answer) == 0.0
    assert math_reward("", c.answer) == 0.0


def test_answer_lengths_have_a_long_tail():
    """Under the shipped tokenizer: the 90th percentile at least 2.5x the median, the longest past
    200 tokens (what issue #27 asks of the task)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(compose(["+experiment=chain_cpu"]).model.path)
    lengths = sorted(len(tok(chain_solution(c))["input_ids"]) for c in make_chains(0, 2000, heldout=False, **CHAIN))
    median, p90 = lengths[len(lengths) // 2], lengths[int(0.9 * len(lengths))]
    assert p90 >= 2.5 * median and lengths[-1] > 200, (median, p90, lengths[-1])
    w = term_weights(8, 1.5)
    assert abs(sum(w) - 1) < 1e-12 and all(a > b for a, b in zip(w, w[1:]))


def test_splits_are_disjoint_reproducible_and_loaded_by_the_experiment():
    from rlspec.data.loading import load_split
    from transformers import AutoTokenizer

    train = make_chains(0, 2000, heldout=False, **CHAIN)
    val = make_chains(1, 200, heldout=True, **CHAIN)
    assert not set(train) & set(val) and len(set(train)) == 2000
    assert all(is_heldout_chain(c) for c in val) and not any(is_heldout_chain(c) for c in train)
    assert make_chains(1, 200, heldout=True, **CHAIN) == val
    cfg = compose(["+experiment=chain_cpu"])
    assert cfg.model.path.endswith("assets/chain/policy")  # `assets` names the family for every group
    assert compose(["+experiment=chain_cpu", "speculation=draft_model"]).speculation.model.endswith("chain/draft")
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    prompts = load_split(cfg.data, "train", tok)
    # the experiment's 240 problems are the first of the same seeded sequence (3 epochs in 60 steps)
    assert len(prompts) == cfg.data.train.num_rows == 240 and not prompts.skipped
    assert cfg.generation.num_prompts_per_step * cfg.trainer.max_steps == 3 * cfg.data.train.num_rows
    assert prompts.prompts[0].text == train[0].question and prompts.prompts[0].answer == train[0].answer
