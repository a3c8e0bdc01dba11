"""Which of a host's devices each server part runs on.

A GPU/NPU process of vLLM takes devices 0..n-1 of what it sees. Two servers on one host
without device lists would both take 0..n-1: the second fails to allocate, or, worse,
both run slowly on the same devices. So where a host runs more than one server part, each
gets a disjoint list, written as CUDA_VISIBLE_DEVICES (cuda) or ASCEND_RT_VISIBLE_DEVICES
(npu): the placement's own `devices`, else the host's next free ones, in spec order. The
host's `devices` (its device count) bounds them. Without it, a host that runs several
parts cannot be placed: `afd launch` refuses it (`Unplaced`), while `afd k8s` and `afd
ray` place each part themselves (a pod's or an actor's own devices). CPU servers get no
lists.
"""

from __future__ import annotations

from dataclasses import replace

VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


class PlacementError(ValueError):
    pass


def place(spec, plans: list) -> tuple[list, str | None]:
    """(`plans` (ServerPlan) with each placement's device list, why some host could not be
    placed on bare hosts or None); PlacementError naming the host, the servers and what is
    allowed where the spec contradicts itself (an overlap, an overcommit)."""
    if spec.platform not in VISIBLE_DEVICES:
        return plans, None
    unplaced = None
    env_name = VISIBLE_DEVICES[spec.platform]
    parts: dict[str, list[tuple[int, int]]] = {}  # host -> (plan index, placement index)
    for i, plan in enumerate(plans):
        for k, p in enumerate(plan.placements):
            parts.setdefault(p.host, []).append((i, k))
    lists: dict[tuple[int, int], tuple[int, ...] | None] = {}
    for host, on_host in parts.items():
        h = spec.hosts[host]
        for env_of, env in (("host", h.env), *[("server", plans[i].spec.env) for i, _ in on_host]):
            if env_name in env:
                raise PlacementError(
                    f"{env_name} is set in a {env_of}'s env on host {host!r}; allowed: "
                    f"[hosts.{host}] devices = N (and a placement's `devices` list), from "
                    "which the spec writes it"
                )
        names = [f"{plans[i].spec.name}" for i, _ in on_host]
        need = [
            plans[i].spec.tensor_parallel_size * plans[i].placements[k].ranks for i, k in on_host
        ]
        explicit = [plans[i].placements[k].devices for i, k in on_host]
        if len(on_host) == 1 and explicit[0] is None:
            if h.devices is not None and need[0] > h.devices:
                raise _overcommit(host, h.devices, names, need)
            lists[on_host[0]] = None if h.devices is None else tuple(range(need[0]))
            continue
        if h.devices is None and any(e is None for e in explicit):
            unplaced = unplaced or (
                f"host {host!r} runs {len(on_host)} server parts ({', '.join(names)}) but the "
                f"spec does not say how many devices it has, so each would take the first "
                f"ones; allowed: [hosts.{host}] devices = N (each part then gets its own), "
                "or a `devices` list on each placement"
            )
            for key in on_host:
                lists[key] = None
            continue
        taken: dict[int, str] = {}
        for name, n, given in zip(names, need, explicit, strict=True):
            if given is not None and len(given) != n:
                raise PlacementError(
                    f"{name} on host {host!r}: devices={list(given)} lists {len(given)} but "
                    f"it runs {n} (tensor_parallel_size x ranks); allowed: {n} device numbers"
                )
            for dev in given or ():
                if h.devices is not None and dev >= h.devices:
                    raise PlacementError(
                        f"{name} on host {host!r}: device {dev} is out of range; allowed: "
                        f"0..{h.devices - 1} ([hosts.{host}] devices = {h.devices})"
                    )
                if dev in taken:
                    raise PlacementError(
                        f"{name} on host {host!r}: device {dev} is also {taken[dev]}'s; "
                        "allowed: device lists that do not overlap"
                    )
                taken[dev] = name
        free = [dev for dev in range(h.devices or 0) if dev not in taken]
        if h.devices is not None and sum(need) > h.devices:
            raise _overcommit(host, h.devices, names, need)
        for key, n, given in zip(on_host, need, explicit, strict=True):
            if given is None:
                given, free = free[:n], free[n:]
            lists[key] = tuple(given)
    placed = [
        replace(plan, devices=tuple(lists[(i, k)] for k in range(len(plan.placements))))
        for i, plan in enumerate(plans)
    ]
    return placed, unplaced


def _overcommit(host: str, count: int, names: list[str], need: list[int]) -> PlacementError:
    parts = ", ".join(f"{n} {c}" for n, c in zip(names, need, strict=True))
    return PlacementError(
        f"host {host!r} has {count} device(s) but its server parts need {sum(need)} ({parts}, "
        "tensor_parallel_size x ranks each); allowed: at most its devices"
    )
