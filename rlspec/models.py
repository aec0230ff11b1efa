"""Model and tokenizer resolution: a local checkpoint directory or a hub ID, the same code path
for rlspec's tiny assets and for Qwen3-8B. Runs before any actor starts, so a missing model
fails fast with the config key and path named."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelPaths:
    """The run's checkpoints as local directories, resolved on the driver before any actor starts."""
    model: str                  # the policy (model.path)
    tokenizer: str              # model.tokenizer, or the policy's own
    draft: str | None = None    # speculation.model (draft model or EAGLE-3 head), when one is used

    def check_visible(self, role: str) -> None:
        """In an actor, before it loads anything: every checkpoint the driver resolved is a folder
        this node can read, else a ModelError naming the node, the key and the path."""
        import socket

        for key, path in (("model.path", self.model), ("model.tokenizer", self.tokenizer),
                          ("speculation.model", self.draft)):
            if path is not None and not Path(path).is_dir():
                raise ModelError(
                    f"{role} on node {socket.gethostname()} cannot read {key}: {path} (resolved on the driver's "
                    "node). Put checkpoints where every node reads them: a shared directory as the key's "
                    "value, or HF_HOME on shared storage for hub IDs (slurm/multi_node.sbatch defaults it "
                    "to the repository's .cache/huggingface).")


class ModelError(ValueError):
    """A model or tokenizer cannot be found or loaded."""


def resolve_checkpoint(name: str, key: str, revision: str | None = None) -> str:
    """Local directory for `name` (a directory path or a hub ID); raises ModelError naming `key`."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists() and not (path / "tokenizer.json").exists() \
                and not (path / "tokenizer_config.json").exists():
            raise ModelError(f"{key}={name!r}: directory has no config.json or tokenizer files")
        return str(path.resolve())
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ModelError(f"{key}={name!r}: no such checkpoint directory (and not a hub ID of the "
                         "form 'org/name')")
    try:
        from huggingface_hub import snapshot_download

        from huggingface_hub import list_repo_files

        files = list_repo_files(name, revision=revision)
        # weights as safetensors where the repository has them, else PyTorch's .bin (never both)
        weights = ["*.safetensors"] if any(f.endswith(".safetensors") for f in files) else ["*.bin", "*.pt"]
        return snapshot_download(name, revision=revision,
                                 allow_patterns=["*.json", *weights, "*.model", "*.txt", "*.tiktoken",
                                                 "*.jinja", "*.py"])
    except Exception as e:  # noqa: BLE001 - offline, missing repo, auth: one clear message
        raise ModelError(
            f"{key}={name!r} is not a local directory and could not be fetched from the Hugging "
            f"Face hub ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). If this "
            "machine is offline, download the checkpoint elsewhere and set "
            f"{key}=/path/to/checkpoint.") from None


def check_context(path: str, max_model_len: int) -> None:
    """model.max_model_len within the positions the checkpoint's config.json gives it
    (max_position_embeddings, times a rope_scaling factor where one is set): vLLM refuses more, but
    only inside the Generator, whose death then says little. A config without the field passes."""
    import json

    cfg = json.loads((Path(path) / "config.json").read_text()) if (Path(path) / "config.json").is_file() else {}
    cfg = cfg.get("text_config") or cfg
    limit = cfg.get("max_position_embeddings")
    if not isinstance(limit, int):
        return
    factor = (cfg.get("rope_scaling") or {}).get("factor") or 1.0
    if max_model_len > limit * factor:
        scaled = f" x rope_scaling factor {factor:g}" if factor != 1.0 else ""
        raise ModelError(f"model.max_model_len={max_model_len} is longer than the {int(limit * factor)} positions "
                         f"{path}/config.json allows (max_position_embeddings {limit}{scaled})")


def load_tokenizer(path: str, key: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"{key}={path!r}: tokenizer could not be loaded ({type(e).__name__}: {e})") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def local_device():
    """The device this process's placement gives it: the first CUDA device it sees (Ray sets
    CUDA_VISIBLE_DEVICES per actor), or the CPU on machines without one."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def release_cached_memory(device) -> None:
    """Between stages: hand the CUDA caching allocator's free blocks back, so the next stage (or a
    colocated role) gets them. Nothing to do on the CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()


def load_causal_lm(path: str, dtype=None, trust_remote_code: bool = False):
    """A Hugging Face causal LM (float32 unless `dtype` says otherwise)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, trust_remote_code=trust_remote_code)
