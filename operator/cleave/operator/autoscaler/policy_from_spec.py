"""An ``LLMService`` spec as the autoscaling policy's config: per-role bounds, targets and the
capacity prior the user wrote (``tokensPerSecondPerReplica``, ``coldStartSeconds``)."""

from __future__ import annotations

from cleave.autoscaling.policy import DECODE, PREFILL, FloorPolicy, PolicyConfig, RolePolicy
from cleave.operator.spec import LLMServiceSpec, Role


def _role_policy(role: Role, prefill: bool, startup_s: float, down_s: float) -> RolePolicy:
    a = role.autoscaling
    if a is None:  # no autoscaling block: the user fixed the count
        return RolePolicy(role.replicas, role.replicas, gpus_per_replica=role.gpus_per_replica,
                          down_window_s=down_s, startup_s=startup_s)
    # Without tokensPerSecondPerReplica the capacity-model rules stay off: latency and KV size
    # the role, helped only by a measured throughput.
    return RolePolicy(a.min_replicas, a.max_replicas,
                      a.ttft_seconds if prefill else a.tpot_seconds,
                      None if prefill else a.kv_cache_usage, role.gpus_per_replica,
                      down_window_s=down_s, prior_throughput=a.tokens_per_second_per_replica,
                      startup_s=startup_s)


def config_from_spec(spec: LLMServiceSpec) -> PolicyConfig:
    """The policy's config; the spec's scale-down delay is every role's down window."""
    timing = {"startup_s": spec.autoscaler.cold_start_seconds,
              "down_s": spec.autoscaler.scale_down_delay_seconds}
    roles = {DECODE: _role_policy(spec.decode, prefill=False, **timing)}
    if spec.prefill is not None:
        roles[PREFILL] = _role_policy(spec.prefill, prefill=True, **timing)
    # The one-worker floor: elastic roles only (both roles autoscaled, so flips are ours). It
    # removes a pod, so it waits the scale-down delay, as any scale-down does.
    floor = FloorPolicy(hold_s=spec.autoscaler.scale_down_delay_seconds) \
        if set(spec.autoscaled_roles()) == {PREFILL, DECODE} else None
    return PolicyConfig(roles, spec.gpu_budget, spec.autoscaler.ratio_bounds, spec.scale_to_zero,
                        spec.autoscaling_mode, floor)
