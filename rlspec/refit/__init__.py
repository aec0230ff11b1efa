"""The refit: after every update the learners' weights go into every Generator engine and
LogprobWorker (policy version += 1), and online draft training's head into every engine. Every
part of it lives in this room, and "refit" names it throughout:

- driver.Refit: the one object the loop calls, built at launch; it owns the transport;
- sender.RefitSender on every learner rank (rank 0 sends), over a source.LearnerSource;
- receiver.RefitReceiver: the four calls of vLLM's weight-sync client protocol, written once for
  every receiving actor (a Generator's vLLM engine, a LogprobWorker's model);
- engine: rlspec's backend of vLLM's RL weight-transfer API, both ends;
- group: rlspec's own transport, a torch.distributed group (gloo on CPU machines).

Transports (cluster.refit): vLLM's `nccl` and `ipc`, rlspec's `group` (all three through vLLM's
weight-transfer API, one collective round per refit) and `object_store` (the tensors through
Ray's object store, into each receiver after the calls already queued on it). This module imports
nothing, so the config's checks read the list from here."""
from __future__ import annotations

COLLECTIVE = ("nccl", "ipc", "group")  # set up by init_weight_transfer_engine; a round takes every receiver
TRANSPORTS = (*COLLECTIVE, "object_store")
