"""vLLM's Ray executor on this CPU. vLLM refuses Ray on its CPU platform only because the platform
names no Ray device key (`CpuPlatform.ray_device_key` is empty: "current platform cpu does not
support ray"). With the key "GPU", the executor asks Ray for the GPUs the test's cluster declares
(none needed: Ray only counts them) and places one worker in each bundle rlspec's placement names,
as on a GPU cluster; each worker then runs vLLM's CPU worker, the ranks talking over gloo. The key
must be set in every Ray worker before vLLM's executor asks it for its devices, which is before
vLLM loads its plugins there: `ray_device_key_for_cpu` is the Ray job's worker setup hook."""


def ray_device_key_for_cpu() -> None:
    import os

    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":   # Model Runner V2 here: before vLLM's import
        from helpers.v2_on_cpu import enable

        enable()
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.ray_device_key = "GPU"


def init_ray(gpus: int = 2, nodes: int = 1):
    """A local Ray cluster of this machine's 2 cores and `gpus` declared GPUs, every worker of it
    (and this process) with the CPU platform's Ray device key; with VLLM_USE_V2_MODEL_RUNNER=1
    (and TRITON_INTERPRET=1) in this process's environment, every worker runs Model Runner V2 as
    tests/helpers/v2_on_cpu.py sets it up. With nodes > 1, that many Ray nodes on loopback
    (ray.cluster_utils), `gpus` declared on each: the cluster, to shut down after ray's."""
    import os

    import ray

    ray_device_key_for_cpu()
    env = {k: os.environ[k] for k in ("PYTHONPATH", "VLLM_USE_V2_MODEL_RUNNER", "TRITON_INTERPRET") if k in os.environ}
    runtime_env = {"worker_process_setup_hook": ray_device_key_for_cpu, "env_vars": env}
    if nodes == 1:
        ray.init(num_cpus=2, num_gpus=gpus, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
        return None
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 2, "num_gpus": gpus, "include_dashboard": False})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=2, num_gpus=gpus)
    ray.init(address=cluster.address, log_to_driver=False, runtime_env=runtime_env)
    cluster.wait_for_nodes()
    return cluster
