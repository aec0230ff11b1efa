"""rlspec's two history drafters as the Generator and 'auto' calibration reach them: the module
behind an engine's speculative_config, and the entry points both modules answer."""
from __future__ import annotations

from rlspec.speculation.history.device import proposer as device_proposer
from rlspec.speculation.history.host import proposer as history_proposer

# What the Generator calls on every worker of an engine with a history drafter (collective_rpc), the
# same in both backends' modules (rlspec/speculation/history/host/proposer.py, device/proposer.py):
# configure (link the runner's drafter; check it is rlspec's), begin_call, finish_call (the call's
# counters: HistoryStats.as_dict), record, set_full ('auto' timing), state_dict, load_state_dict.
DRAFTER_CALLS = ("configure", "begin_call", "finish_call", "record", "set_full", "state_dict", "load_state_dict")


def history_drafter(spec_config: dict | None):
    """rlspec's history drafter module behind an engine's speculative_config (the host proposer's
    or the device drafter's), or None for any other method."""
    spec_config = spec_config or {}
    if spec_config.get("method") == "custom_class" and spec_config.get("model") == history_proposer.PROPOSER:
        return history_proposer
    if spec_config.get("method") == "ngram_gpu" and spec_config.get("model") == device_proposer.MARK:
        return device_proposer
    return None
