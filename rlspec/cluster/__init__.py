"""Ray: the placement plan and its placement groups, starting and stopping Ray, typed actor handles,
bounded waits, fan-out over several engines and workers, and launching every actor."""
