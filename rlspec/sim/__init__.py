"""rlspec's cluster simulator: projects one GRPO step (data, prep, generation, log-prob, train,
refit) with and without speculative rollouts from model shapes, GPU datasheet figures, measured
acceptance and a few measured efficiencies; calibrated on real runs' summary.json.

    python -m rlspec.sim +scenario=paper_rl_zero_8b
    python -m rlspec.sim calibrate RUN_DIR --check OTHER_RUN_DIR

Pure Python: imports nothing from the trainer's workers, Ray, vLLM or DeepSpeed.
"""
