"""Where engines and trainer ranks run: one Ray placement group per run.

    colocated      n = max(engines, ranks) bundles; engine i and rank i share bundle i (on
                   GPUs: one device, half a Ray GPU each; the engine sleeps while the
                   trainer trains)
    disaggregated  a bundle of its own for every engine and every rank (own devices, or
                   own CPU cores)

Bundles are packed onto as few nodes as fit, so the same config runs on one machine or
across a Ray cluster.
"""

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


def place(mode: str, device: str, num_engines: int, num_ranks: int, engine_cpus: int,
          rank_cpus: int, timeout_s: float = 120) -> tuple[list[dict], list[dict]]:
    """Ray actor options (`actor.options(**o)`) for each engine and each trainer rank."""
    gpu = {"GPU": 1} if device == "cuda" else {}
    if mode == "colocated":  # they share the cores: reserve one per bundle, ask for none
        n = max(num_engines, num_ranks)
        bundles = [{"CPU": 1, **gpu}] * n
        engine_at, rank_at = [i % n for i in range(num_engines)], list(range(num_ranks))
        engine_cpus = rank_cpus = 0
    else:
        bundles = [{"CPU": engine_cpus, **gpu}] * num_engines + [{"CPU": rank_cpus, **gpu}] * num_ranks
        engine_at, rank_at = list(range(num_engines)), list(range(num_engines, len(bundles)))
    pg = placement_group(bundles, strategy="PACK")
    if not pg.wait(timeout_s):
        ray.util.remove_placement_group(pg)
        raise RuntimeError(
            f"Ray cannot place {mode} bundles {bundles} (available: {ray.available_resources()});"
            " lower --rollout.threads / --train.threads-per-rank, use fewer engines or ranks, "
            "or --rollout.placement colocated")
    share = 0.5 if mode == "colocated" and gpu else (1 if gpu else 0)

    def options(bundle: int, cpus: int) -> dict:
        return dict(num_cpus=cpus, num_gpus=share, scheduling_strategy=
                    PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle))
    return ([options(b, engine_cpus) for b in engine_at], [options(b, rank_cpus) for b in rank_at])
