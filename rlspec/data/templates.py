"""Prompt templates: RL-Zero (base model, plain text prompt) and RL-Think (chat template, thinking)."""
from __future__ import annotations

from typing import Callable

RL_ZERO_TEMPLATE = "{prompt}\n"

TemplateFn = Callable[[str, object], str]
TEMPLATES: dict[str, TemplateFn] = {}


def register_template(name: str):
    def deco(fn: TemplateFn) -> TemplateFn:
        TEMPLATES[name] = fn
        return fn
    return deco


@register_template("rl_zero")
def rl_zero(prompt: str, tokenizer) -> str:
    """Base-model RL ("zero"): the question as plain text, the answer follows it."""
    return RL_ZERO_TEMPLATE.format(prompt=prompt)


@register_template("rl_think")
def rl_think(prompt: str, tokenizer) -> str:
    """Reasoning model: the tokenizer's chat template, with thinking enabled."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("data.template=rl_think needs a tokenizer with a chat template")
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=True)


@register_template("raw")
def raw(prompt: str, tokenizer) -> str:
    """The prompt exactly as the dataset has it."""
    return prompt


def apply_template(name: str, prompt: str, tokenizer) -> str:
    if name not in TEMPLATES:
        raise KeyError(f"data.template={name!r} is not one of {sorted(TEMPLATES)}")
    return TEMPLATES[name](prompt, tokenizer)
