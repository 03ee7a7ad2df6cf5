"""`GET /metrics`: the engine's gauges and counters in Prometheus text format."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engines.protocol import HealthReply

# engine metric name -> (Prometheus name, help, is a counter)
ENGINE_METRICS = {
    "kv_cache_usage": ("lmi_kv_cache_usage_ratio", "fraction of KV cache blocks in use", False),
    "kv_blocks_total": ("lmi_kv_cache_blocks", "KV cache blocks", False),
    "kv_blocks_free": ("lmi_kv_cache_free_blocks", "free KV cache blocks", False),
    "kv_slots_allocated": ("lmi_kv_slots_allocated", "KV token slots held by running requests", False),
    "kv_slots_unused": ("lmi_kv_slots_unused", "allocated KV token slots not holding a token", False),
    "prefix_cache_hit_rate": ("lmi_prefix_cache_hit_rate", "prompt tokens served from the prefix cache", False),
    "prefix_cache_hit_tokens": ("lmi_prefix_cache_hit_tokens", "prompt tokens found in the prefix cache", True),
    "prefix_cache_query_tokens": ("lmi_prefix_cache_query_tokens", "prompt tokens looked up", True),
    "preemptions": ("lmi_preemptions", "requests preempted (recomputed later)", True),
    "spec_proposed_tokens": ("lmi_spec_decode_proposed_tokens", "tokens proposed by speculative decoding", True),
    "spec_accepted_tokens": ("lmi_spec_decode_accepted_tokens", "proposed tokens the model accepted", True),
    "spec_verifications": ("lmi_spec_decode_verifications", "request-steps that verified proposed tokens", True),
    "spec_acceptance_rate": ("lmi_spec_decode_acceptance_rate", "accepted / proposed tokens", False),
    "spec_mean_accepted_length": ("lmi_spec_decode_mean_accepted_length",
                                  "tokens emitted per verification (accepted proposals + 1)", False),
    "multi_step_runs": ("lmi_multi_step_runs", "plans that ran several decode steps back to back", True),
    "grammar_masks": ("lmi_grammar_masks", "allowed-token masks computed for constrained requests", True),
    "grammar_mask_seconds": ("lmi_grammar_mask_seconds", "time computing those masks (mostly during the forward)",
                             True),
    "grammar_wait_seconds": ("lmi_grammar_wait_seconds", "time sampling waited for masks (not hidden by the forward)",
                             True),
    "grammar_rollbacks": ("lmi_grammar_rollbacks", "grammar rollbacks past rejected speculative tokens", True),
    "requests_shed": ("lmi_requests_shed", "requests answered 503 because they could not start before their deadline "
                      "(parameters.timeout, X-Request-Timeout, option.max_queue_wait_ms)", True),
    "priority_preemptions": ("lmi_priority_preemptions", "running requests preempted for a waiting one of higher "
                             "priority", True),
    "step_time_model_decode_seconds": ("lmi_step_time_model_decode_seconds", "option.target_tpot_ms: the step time "
                                       "the scheduler's model predicts for decoding the running batch", False),
    "kv_tiers_loaded_blocks": ("lmi_kv_tiers_loaded_blocks", "blocks loaded from a KV tier into the pool", True),
    "kv_tiers_refused_blocks": ("lmi_kv_tiers_refused_blocks",
                                "blocks a KV tier offered that some rank could not load (recomputed)", True),
}
# per KV tier (docs/kv-tiers.md): engine metric kv_tier_<tier>_<what> -> lmi_kv_tier_<what>{tier="<tier>"}
KV_TIERS = ("host", "disk")
TIER_METRICS = {
    "hit_tokens": ("prompt tokens the tier's blocks spared from recomputing", True),
    "hit_rate": ("prompt tokens looked up that the tier's blocks spared", False),
    "bytes": ("bytes the tier holds (this copy's share)", False),
    "blocks": ("blocks the tier holds (this copy's share)", False),
    "capacity_bytes": ("bytes the tier may hold (this copy's share)", False),
    "written_bytes": ("bytes written to the tier", True),
    "read_bytes": ("bytes read from the tier", True),
    "loaded_blocks": ("blocks read from the tier", True),
    "load_seconds": ("time reading and checking blocks from the tier", True),
    "refused_blocks": ("files refused: torn, foreign or colliding", True),
    "write_errors": ("writes the file system refused (full, folder gone): those blocks not kept", True),
}


# per tenant (option.fair_share_key; docs/scheduling.md): engine metric tenant/<what>/<tenant> ->
# lmi_tenant_<what>{tenant="<tenant>"}
TENANT_METRICS = {
    "admitted_requests": ("requests admitted to the running batch", True),
    "admitted_tokens": ("prompt + max_new_tokens of the requests admitted", True),
    "shed_requests": ("requests shed with a 503 (deadline)", True),
    "waiting": ("requests waiting for admission", False),
    "running": ("requests in the running batch", False),
}


def _engine_metric(key: str) -> tuple[str, str, bool, str | None, str | None] | None:
    """An engine metric's Prometheus name, help, whether a counter, and its label's name and value (if any)."""
    if key in ENGINE_METRICS:
        return (*ENGINE_METRICS[key], None, None)
    if key.startswith("tenant/"):
        _, what, tenant = key.split("/", 2)
        return (f"lmi_tenant_{what}", *TENANT_METRICS[what], "tenant", tenant) if what in TENANT_METRICS else None
    for tier in KV_TIERS:
        what = key.removeprefix(f"kv_tier_{tier}_")
        if what != key and what in TIER_METRICS:
            return (f"lmi_kv_tier_{what}", *TIER_METRICS[what], "tier", tier)
    return None


class _EngineCollector:
    """One engine's reply, or several model copies' (each sample then labelled copy="<i>"), or several
    models' (labelled model="<name>", and copy when it has copies): replies are (label values, reply)
    under `names`."""

    def __init__(self, replies: list[tuple[tuple[str, ...], HealthReply]], engine_kind: str | list[str],
                 names: tuple[str, ...] = ()):
        self.replies = replies
        self.kinds = engine_kind if isinstance(engine_kind, list) else [engine_kind] * len(replies)
        self.names = names

    def collect(self):
        def family(cls, name, doc, labels=()):
            return cls(name, doc, labels=[*self.names, *labels])

        def key(label):
            return list(label)

        up = family(GaugeMetricFamily, "lmi_engine_ready", "1 when the engine is ready", ["engine", "state"])
        plain = {"lmi_requests_waiting": (GaugeMetricFamily, "requests waiting for admission", "num_waiting"),
                 "lmi_requests_running": (GaugeMetricFamily, "requests in the running batch", "num_running"),
                 "lmi_engine_steps": (CounterMetricFamily, "engine steps (dynamic: batches; custom handler: calls)",
                                      "num_batches"),
                 "lmi_kv_slots_in_use": (GaugeMetricFamily, "KV token slots held", "num_kv_slots")}
        families = {name: family(cls, name, doc) for name, (cls, doc, _) in plain.items()}
        phases = family(GaugeMetricFamily, "lmi_startup_phase_seconds", "seconds each start-up phase took (ready: "
                        "the whole cold start)", ["phase"])
        engine: dict[str, object] = {}
        for (label, r), engine_kind in zip(self.replies, self.kinds):
            up.add_metric([*key(label), engine_kind, r.state], 1.0 if r.state == "ready" else 0.0)
            for name, (_, _, field) in plain.items():
                families[name].add_metric(key(label), getattr(r, field))
            for phase, seconds in r.startup.items():
                phases.add_metric([*key(label), phase], seconds)
            for k, value in r.metrics.items():
                known = _engine_metric(k)
                if known is not None:
                    name, doc, is_counter, label_name, label_value = known
                    if name not in engine:
                        engine[name] = family(CounterMetricFamily if is_counter else GaugeMetricFamily, name, doc,
                                              [label_name] if label_name else ())
                    engine[name].add_metric([*key(label), *([label_value] if label_name else [])], value)
        yield up
        yield from families.values()
        yield phases
        for _, r in self.replies[:1]:  # (LoRA runs with one copy, and one model of several does not label them)
            yield from _adapter_families(r.adapters) if "model" not in self.names else ()
        yield from engine.values()


# LoRA adapter → (Prometheus name, help, is a counter, its AdapterInfo field)
ADAPTER_METRICS = (
    ("lmi_lora_requests", "finished requests per LoRA adapter", True, "requests"),
    ("lmi_lora_prompt_tokens", "prompt tokens of finished requests per LoRA adapter", True, "prompt_tokens"),
    ("lmi_lora_generated_tokens", "tokens generated for finished requests per LoRA adapter", True, "generated_tokens"),
    ("lmi_lora_requests_running", "requests running per LoRA adapter", False, "num_running"),
    ("lmi_lora_requests_waiting", "requests waiting per LoRA adapter", False, "num_waiting"),
    ("lmi_lora_resident", "1 while the LoRA adapter is in a device slot", False, "slot"),
)


def _adapter_families(adapters):
    if not adapters:
        return
    for name, doc, is_counter, field in ADAPTER_METRICS:
        family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(name, doc, labels=["adapter"])
        for a in adapters:
            value = getattr(a, field)
            family.add_metric([a.name], float(bool(value)) if field == "slot" else value)
        yield family


class _Families:
    def __init__(self, families):
        self.families = families

    def collect(self):
        yield from self.families()


def render(reply: HealthReply | list[HealthReply | None], engine_kind: str, request_families=None) -> bytes:
    """The engine's metrics (several model copies' replies: labelled by copy, a copy that does not answer
    left out), then (when given) the HTTP workers' request metrics."""
    registry = CollectorRegistry()
    replies = [((str(i),), r) for i, r in enumerate(reply) if r is not None] if isinstance(reply, list) else \
        [((), reply)]
    registry.register(_EngineCollector(replies, engine_kind, ("copy",) if isinstance(reply, list) else ()))
    if request_families is not None:
        registry.register(_Families(request_families))
    return generate_latest(registry)


# model registry counters and gauges (docs/multi-model.md): (name, help, is a counter, its ModelRecord field)
MODEL_METRICS = (
    ("lmi_model_loads", "times the model was loaded", True, "loads"),
    ("lmi_model_unloads", "times the model was unloaded while registered (to make room, or to scale)", True,
     "unloads"),
    ("lmi_model_evictions", "times the model was unloaded to make room for another", True, "evictions"),
    ("lmi_model_memory_bytes", "what the memory budget counts for the model while it is loaded", False, None),
)


def render_models(table, replies: list[tuple[str, HealthReply | list[HealthReply | None] | None]],
                  request_families=None) -> bytes:
    """Several models (or SageMaker's multi-model mode): every engine sample labelled model="<name>"
    (and copy="<i>" for a model with copies; one that does not answer left out), the registry's
    counters per model, the budget, then the HTTP workers' request metrics."""
    registry = CollectorRegistry()
    kinds = {m.name: m.engine_kind for m in table.models}
    rows, row_kinds = [], []
    has_copies = any(isinstance(r, list) for _, r in replies)
    for name, reply in replies:
        for i, r in (enumerate(reply) if isinstance(reply, list) else [(0, reply)]):
            if r is not None:
                rows.append(((name, str(i)) if has_copies else (name,), r))
                row_kinds.append(kinds.get(name, ""))
    registry.register(_EngineCollector(rows, row_kinds, ("model", "copy") if has_copies else ("model",)))
    registry.register(_Families(lambda: _model_families(table)))
    if request_families is not None:
        registry.register(_Families(request_families))
    return generate_latest(registry)


def _model_families(table):
    state = GaugeMetricFamily("lmi_model_state", "1 for the model's state (loading, ready, unloading, unloaded, "
                              "failed)", labels=["model", "state"])
    for m in table.models:
        state.add_metric([m.name, m.state], 1.0)
    yield state
    for name, doc, is_counter, field in MODEL_METRICS:
        family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(name, doc, labels=["model"])
        for m in table.models:
            family.add_metric([m.name], float(getattr(m, field) if field else m.need_bytes if m.dir else 0))
        yield family
    yield GaugeMetricFamily("lmi_models_memory_budget_bytes", "the memory budget of the models loaded at once",
                            value=float(table.budget_bytes))
