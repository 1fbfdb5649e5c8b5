"""Where engines and trainer ranks run: one Ray placement group per run.

    colocated      n = max(engines, ranks) bundles; engine i and rank i share bundle i (on
                   GPUs: one device, half a Ray GPU each; the engine sleeps while the
                   trainer trains)
    disaggregated  a bundle of its own for every engine and every rank (own devices, or
                   own CPU cores); an engine's bundle holds its `tensor_parallel` GPUs, all
                   on one node

Bundles are packed onto as few nodes as fit, so the same config runs on one machine or
across a Ray cluster. To choose the nodes, give them a custom resource at `ray start` and
name it: each engine (or rank) bundle then takes one unit of it.

    ray start ... --resources '{"rollout": 8}'     # nodes for 8 engines each
    ray start ... --resources '{"train": 8}'       # nodes for 8 trainer ranks each
    instar rl --rollout.placement disaggregated \\
        --cluster.engine-resource rollout --cluster.trainer-resource train
"""

import ray
from ray.util.placement_group import placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from instar.errors import LayoutError


def check_engine_gpus(tensor_parallel: int, nodes: list[dict], resource: str = "") -> None:
    """Refuse engines of `tensor_parallel` GPUs when no node has that many (a bundle is never
    split across nodes, so Ray would wait forever). `nodes`: `ray.nodes()`; `resource`: only
    nodes that have it can hold an engine (--cluster.engine-resource)."""
    gpus = [n["Resources"].get("GPU", 0) for n in nodes if n.get("Alive", True)
            and (not resource or n["Resources"].get(resource, 0) > 0)]
    if tensor_parallel > max(gpus, default=0):
        raise LayoutError(
            f"--rollout.tensor-parallel {tensor_parallel}: an engine needs {tensor_parallel} GPUs "
            f"on one node, but the most any{f' {resource!r}' if resource else ''} node of the "
            f"Ray cluster has is {max(gpus, default=0):g}; lower --rollout.tensor-parallel")


def check_gpu_count(bundles: list[dict], nodes: list[dict], mode: str) -> None:
    """Refuse a layout that needs more GPUs than the Ray cluster has, at once and saying which
    flags to set (Ray would wait for them forever)."""
    need = sum(b.get("GPU", 0) for b in bundles)
    have = sum(n["Resources"].get("GPU", 0) for n in nodes if n.get("Alive", True))
    if need > have:
        count = ("max(--rollout.num-engines, --train.num-ranks)" if mode == "colocated" else
                 "--rollout.num-engines x --rollout.tensor-parallel + --train.num-ranks")
        raise LayoutError(f"{mode} engines and trainer ranks need {need:g} GPUs ({count}), but "
                           f"the Ray cluster has {have:g}: lower --rollout.num-engines or "
                           f"--train.num-ranks")


def place(mode: str, device: str, num_engines: int, num_ranks: int, engine_cpus: int,
          rank_cpus: int, engine_resource: str = "", rank_resource: str = "", *,
          tensor_parallel: int = 1, one_host: bool = False,
          timeout_s: float = 120) -> tuple[list[dict], list[dict], object]:
    """Ray actor options (`actor.options(**o)`) for each engine and each trainer rank, and the
    placement group (remove it with `ray.util.remove_placement_group` when the run ends).
    `tensor_parallel`: GPUs per engine (disaggregated); `one_host`: refuse a placement across
    hosts (the file transport passes the weights through one host's /dev/shm)."""
    gpu = {"GPU": 1} if device == "cuda" else {}
    if gpu and tensor_parallel > 1:
        check_engine_gpus(tensor_parallel, ray.nodes(), engine_resource)
    if mode == "colocated":  # they share the cores: reserve one per bundle, ask for none
        n = max(num_engines, num_ranks)
        bundles = [{"CPU": 1, **gpu}] * n
        engine_at, rank_at = [i % n for i in range(num_engines)], list(range(num_ranks))
        engine_cpus = rank_cpus = 0
    else:
        engine = {"CPU": engine_cpus, **({"GPU": tensor_parallel} if gpu else {}),
                  **({engine_resource: 1} if engine_resource else {})}
        rank = {"CPU": rank_cpus, **gpu, **({rank_resource: 1} if rank_resource else {})}
        bundles = [engine] * num_engines + [rank] * num_ranks
        engine_at, rank_at = list(range(num_engines)), list(range(num_engines, len(bundles)))
    if gpu:
        check_gpu_count(bundles, ray.nodes(), mode)
    pg = placement_group(bundles, strategy="PACK")
    if not pg.wait(timeout_s):
        ray.util.remove_placement_group(pg)
        raise LayoutError(
            f"Ray cannot place {mode} bundles {bundles} (available: {ray.available_resources()});"
            " lower --rollout.threads / --train.threads-per-rank, use fewer engines or ranks, "
            "--rollout.placement colocated, or give nodes the resources named by "
            "--cluster.engine-resource / --cluster.trainer-resource")
    hosts = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    used = {hosts[node] for node in placement_group_table(pg)["bundles_to_node_id"].values()}
    if one_host and len(used) > 1:
        ray.util.remove_placement_group(pg)
        raise LayoutError(f"engines and ranks were placed on hosts {sorted(used)}, but "
                           "--rollout.transport file passes weights through one host's "
                           "/dev/shm; on GPUs use --rollout.transport nccl")
    share = 0.5 if mode == "colocated" and gpu else (1 if gpu else 0)

    def options(bundle: int, cpus: int, gpus: float) -> dict:
        return dict(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=
                    PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle))
    return ([options(b, engine_cpus, share * tensor_parallel) for b in engine_at],
            [options(b, rank_cpus, share) for b in rank_at], pg)
