"""python -m rlspec.sim [+scenario=NAME] [key=value ...]: simulate one GRPO step with and without
speculative rollouts; prints a table and writes sim.json and PNG plots to the Hydra run directory.

python -m rlspec.sim calibrate RUN_DIR [--check RUN_DIR ...]: fit the efficiencies to a real run
(see rlspec/sim/calibrate.py).

Exit codes: 0 done; 2 bad config or run directory.
"""
from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from rlspec.sim.config import SimConfigError, register_configs, validate
from rlspec.sim.report import simulate, table, write

register_configs()


@hydra.main(config_path="../../conf/sim", config_name="sim", version_base="1.3")
def run(dcfg: DictConfig) -> None:
    cfg = OmegaConf.to_object(dcfg)
    try:
        validate(cfg)
    except SimConfigError as e:
        print(f"rlspec.sim: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    result = simulate(cfg)
    print(table(result), flush=True)
    out = HydraConfig.get().runtime.output_dir
    for path in write(result, out, cfg.plot):
        print(f"wrote {path}", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "calibrate":
        from rlspec.sim.calibrate import cli

        sys.exit(cli(sys.argv[2:]))
    run()


if __name__ == "__main__":
    main()
