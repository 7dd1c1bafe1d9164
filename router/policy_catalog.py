"""Every routing policy by its ``--policy`` name, and the class that implements it.

The one line a new policy adds (``CONTRIBUTING.md``, "Adding a policy"). It sits in the base
layer so that configuration can offer exactly these names; the classes are written as
``"module:Class"`` and imported by the routing room's registry
(:mod:`kvroute.router.routing.policies.registry`), never from here.
"""

from __future__ import annotations

#: In the order ``kvroute serve --help`` and the README list them.
POLICY_CLASSES: dict[str, str] = {
    "round_robin": "kvroute.router.routing.policies.simple:RoundRobin",
    "least_load": "kvroute.router.routing.policies.simple:LeastLoad",
    "random": "kvroute.router.routing.policies.simple:Random",
    "power_of_two": "kvroute.router.routing.policies.simple:PowerOfTwo",
    "sticky": "kvroute.router.routing.policies.sticky:Sticky",
    "cache_aware": "kvroute.router.routing.policies.cache_aware:CacheAware",
}

POLICY_NAMES: tuple[str, ...] = tuple(POLICY_CLASSES)
