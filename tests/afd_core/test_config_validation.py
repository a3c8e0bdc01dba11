"""The config_validation and engine_core patches inside vLLM's real config building."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine_config(checkpoints):
    import afd_plugin

    afd_plugin.register_afd()
    from vllm.engine.arg_utils import EngineArgs

    model = str(checkpoints("qwen3_moe"))

    def build(afd=None, **kw):
        kw.setdefault("enforce_eager", True)
        extra = {"additional_config": {"afd": afd}} if afd is not None else {}
        return EngineArgs(model=model, max_model_len=128, **extra, **kw).create_engine_config()

    return build


def test_auto_worker_becomes_the_role_worker(engine_config):
    att = engine_config({"role": "attention"})
    assert att.parallel_config.worker_cls == "afd_core.workers.cpu_worker.AFDCPUAttentionWorker"
    ffn = engine_config({"role": "ffn"})
    assert ffn.parallel_config.worker_cls == "afd_core.workers.cpu_worker.AFDCPUFFNWorker"
    assert ffn.cache_config.enable_prefix_caching is False  # an FFN engine has no KV cache


def test_a_server_may_hold_some_ranks_of_a_role(engine_config):
    """Several servers per role: each holds the ranks from its start_rank (the missing ones
    are named at connect time, not here)."""
    for afd in (
        {"role": "attention", "num_attention_ranks": 2, "start_rank": 1},
        {"role": "ffn", "num_ffn_ranks": 2, "num_attention_ranks": 2, "start_rank": 1},
        {"role": "ffn", "num_ffn_ranks": 2, "num_attention_ranks": 2},
    ):
        role = "Attention" if afd["role"] == "attention" else "FFN"
        assert engine_config(afd).parallel_config.worker_cls.endswith(f"AFDCPU{role}Worker")


def test_an_ffn_server_with_data_parallelism_is_an_expert_group_of_ffn_ranks(engine_config):
    cfg = engine_config(
        {"role": "ffn", "num_ffn_ranks": 2, "num_attention_ranks": 2}, data_parallel_size=2
    )
    assert cfg.parallel_config.worker_cls.endswith("AFDCPUFFNWorker")
    assert cfg.parallel_config.data_parallel_size == 2


def test_each_tensor_parallel_rank_of_an_attention_server_is_an_attention_rank(engine_config):
    cfg = engine_config({"role": "attention", "num_attention_ranks": 2}, tensor_parallel_size=2)
    assert cfg.parallel_config.worker_cls.endswith("AFDCPUAttentionWorker")


def test_no_afd_key_changes_nothing(engine_config):
    assert engine_config().parallel_config.worker_cls == "vllm.v1.worker.cpu_worker.CPUWorker"


def test_explicit_matching_worker_is_kept(engine_config):
    cls = "afd_core.workers.cpu_worker.AFDCPUFFNWorker"
    assert engine_config({"role": "ffn"}, worker_cls=cls).parallel_config.worker_cls == cls


def test_explicit_mismatching_worker_names_both(engine_config):
    with pytest.raises(
        Exception,
        match=r"vllm.v1.worker.cpu_worker.CPUWorker.*does not match AFD role 'ffn'.*AFDCPUFFNWorker",
    ):
        engine_config({"role": "ffn"}, worker_cls="vllm.v1.worker.cpu_worker.CPUWorker")


@pytest.mark.parametrize(
    "afd,kw,match",
    [
        ({"role": "attention", "port": 0}, {}, r"port=0 is invalid"),
        (
            {"role": "attention", "num_attention_ranks": 2, "start_rank": 2},
            {},
            r"start_rank=2 is out of range for an attention server .* 2 attention rank\(s\); "
            r"allowed: 0..1",
        ),
        (
            {"role": "ffn", "num_ffn_ranks": 2, "num_attention_ranks": 2, "start_rank": 1},
            {"data_parallel_size": 2},
            r"runs --data-parallel-size=2 FFN ranks 1..2, but the deployment has "
            r"num_ffn_ranks=2",
        ),
        (
            {"role": "ffn", "num_ffn_ranks": 4, "num_attention_ranks": 4},
            {"data_parallel_size": 2, "tensor_parallel_size": 2},
            r"--data-parallel-size=2 and --tensor-parallel-size=2 is not supported; allowed: "
            r"--tensor-parallel-size 1",
        ),
        (
            {"role": "ffn", "num_ffn_ranks": 2, "num_attention_ranks": 2},
            {"data_parallel_size": 2, "enable_expert_parallel": True},
            r"--enable-expert-parallel on an FFN server is not supported on CPU.*segfault",
        ),
        (
            {"role": "attention", "num_attention_ranks": 2, "start_rank": 1},
            {"data_parallel_size": 2},
            r"runs 2 workers .* as attention ranks 1..2, but the deployment has "
            r"num_attention_ranks=2",
        ),
        ({"role": "attention"}, {"enforce_eager": False}, r"add --enforce-eager"),
        (
            {"role": "attention", "compute_gate_on_attention": True},
            {},
            r"compute_gate_on_attention=True is not supported for Qwen3MoeForCausalLM "
            r"\(AFDQwen3MoeForCausalLM runs the router on the FFN side\); allowed: false",
        ),
    ],
)
def test_bad_deployments_fail_at_config_time(engine_config, afd, kw, match):
    with pytest.raises(Exception, match=match):
        engine_config(afd, **kw)


@pytest.mark.parametrize(
    "afd,kw,m",
    [
        ({}, {}, 1),
        ({}, {"enable_dbo": True}, 2),
        ({"num_microbatches": 4}, {"enable_dbo": True}, 4),
        ({"num_microbatches": 3}, {}, 3),
        ({}, {"ubatch_size": 3}, 3),
        ({"num_microbatches": "auto"}, {}, "auto"),  # chosen per step, up to 4
        ({"num_microbatches": "Auto"}, {"enable_dbo": True}, "auto"),
    ],
)
def test_microbatches_are_resolved_for_afd_and_vllm_dbo_stays_off(engine_config, afd, kw, m):
    cfg = engine_config({"role": "attention", **afd}, **kw)
    assert cfg.additional_config["afd"]["num_microbatches"] == m
    pc = cfg.parallel_config
    # AFD's step engine splits the steps; vLLM's CUDA-only micro-batching stays off
    assert pc.enable_dbo is False and pc.ubatch_size == 0 and not pc.use_ubatching
    assert pc.dbo_decode_token_threshold == 32 and pc.dbo_prefill_token_threshold == 512


@pytest.mark.parametrize(
    "afd,kw,match",
    [
        ({"role": "ffn"}, {"enable_dbo": True}, r"--enable-dbo on an FFN server"),
        ({"role": "ffn", "num_microbatches": 2}, {}, r"afd.num_microbatches=2 on an FFN server"),
        ({"role": "attention", "num_microbatches": 5}, {}, r"num_microbatches=5 is invalid"),
        (
            {"role": "ffn", "num_microbatches": "auto"},
            {},
            r"afd.num_microbatches=auto on an FFN server",
        ),
        (
            {"role": "attention", "num_microbatches": "auto"},
            {"ubatch_size": 2},
            r"--ubatch-size=2 and afd.num_microbatches='auto' disagree",
        ),
        (
            {"role": "attention", "num_microbatches": "auto", "num_attention_ranks": 2},
            {"tensor_parallel_size": 2},
            r"'auto' with --tensor-parallel-size=2: each TP rank would measure",
        ),
        (
            {"role": "attention", "num_microbatches": "auto"},
            {"dbo_decode_token_threshold": 1},
            r"at least 2 with afd.num_microbatches='auto'",
        ),
        (
            {"role": "attention", "num_microbatches": 1},
            {"enable_dbo": True},
            r"--enable-dbo asks for micro-batches but afd.num_microbatches=1",
        ),
        (
            {"role": "attention", "num_microbatches": 2},
            {"ubatch_size": 3},
            r"--ubatch-size=3 and afd.num_microbatches=2 disagree",
        ),
        ({"role": "attention"}, {"ubatch_size": 8}, r"8 micro-batches per step.*allowed 1..4"),
        (
            {"role": "attention", "num_microbatches": 4},
            {"enable_dbo": True, "dbo_decode_token_threshold": 2},
            r"--dbo-decode-token-threshold=2 .* at least the number of micro-batches \(4\)",
        ),
        (
            {"role": "attention"},
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            r"speculative decoding .*method 'ngram'.* not supported yet",
        ),
        (
            {"role": "attention"},
            {"tensor_parallel_size": 2},
            r"runs 2 workers \(data parallel 1 x tensor parallel 2\) as attention ranks 0..1, "
            r"but the deployment has num_attention_ranks=1",
        ),
    ],
)
def test_flags_that_cannot_apply_stop_startup(engine_config, afd, kw, match):
    with pytest.raises(Exception, match=match):
        engine_config(afd, **kw)


def test_ffn_engine_rejects_requests():
    import afd_plugin

    afd_plugin.register_afd()
    from vllm.exceptions import GracefulHTTPError
    from vllm.v1.engine.async_llm import AsyncLLM  # importing applies the deferred patch

    from afd_core import registration as reg
    from afd_core.patches.catalogue import is_patched, original

    assert is_patched(AsyncLLM, "check_admission")
    assert reg.records()["patch:engine_core"].status is reg.StepStatus.APPLIED
    assert original(AsyncLLM, "check_admission") is not AsyncLLM.check_admission

    class Fake:
        def __init__(self, afd):
            self.vllm_config = type("C", (), {"additional_config": afd})()

    with pytest.raises(GracefulHTTPError, match="AFD FFN server") as e:
        AsyncLLM.check_admission(Fake({"afd": {"role": "ffn"}}))
    assert e.value.http_status == 400


def test_a_wrapper_that_cannot_be_imported_here_stops_start_up_naming_what_is_missing():
    """Qwen3.5-MoE: vLLM's qwen3_5 module imports torchvision (the Qwen-VL image
    processor), which this environment does not have."""
    import importlib.util
    from types import SimpleNamespace

    import afd_plugin
    from afd_core.config import parse_afd_config
    from afd_core.patches.config_validation import validate_model

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here: the wrapper imports")
    afd_plugin.register_afd()
    arch = "Qwen3_5MoeForConditionalGeneration"
    config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=[arch]))
    )
    with pytest.raises(
        Exception,
        match=rf"the wrapper of {arch} cannot be imported here: "
        r".*No module named 'torchvision'",
    ):
        validate_model(parse_afd_config({"role": "ffn"}), config)


def test_async_dp_runs_the_attention_servers_dp_ranks_as_vllms_independent_engines(
    engine_config,
):
    """afd.async_dp on an attention server: vLLM's dense-model DP path (pinned against
    vLLM 0.32's source: run_engine_core picks DPEngineCoreProc by model_config.is_moe)."""
    import copy
    import inspect
    import pickle

    from vllm.v1.engine.core import EngineCoreProc

    from afd_core.config import parse_afd_config
    from afd_core.patches.async_dp_engine import VLLM_BRANCH
    from afd_core.workers.roles import role_rank, steps_with

    assert VLLM_BRANCH in inspect.getsource(EngineCoreProc.run_engine_core)
    afd = {"role": "attention", "num_attention_ranks": 4, "async_dp": True}
    cfg = engine_config(afd, data_parallel_size=2, tensor_parallel_size=2)
    assert cfg.model_config.is_moe is False and cfg.parallel_config.is_moe_model is False
    assert cfg.model_config.get_num_experts() > 0  # the model itself is the MoE model
    assert cfg.needs_dp_coordinator  # load-balancing stats, no waves
    # the engine-core and worker processes get the config pickled
    assert pickle.loads(pickle.dumps(cfg)).model_config.is_moe is False
    # each engine: DP size 1, its index kept, and AFD numbers its ranks by that index
    pc = copy.deepcopy(cfg.parallel_config)
    pc.data_parallel_index = 1
    pc.reconfigure_for_independent_dp_rank()
    assert (pc.data_parallel_size, pc.data_parallel_rank, pc.data_parallel_index) == (1, 0, 1)
    parsed = parse_afd_config(afd, device_type="cpu")
    one = copy.copy(cfg)
    one.parallel_config = pc
    assert [role_rank(one, parsed, tp) for tp in (0, 1)] == [2, 3]
    # the FFN rank waits for DP rank 1's two TP ranks together, not for DP rank 0's
    assert [steps_with(one, parsed, r) for r in (2, 3)] == [2, 2]
    lockstep = parse_afd_config({**afd, "async_dp": False}, device_type="cpu")
    assert steps_with(one, lockstep, 3) == 0


def test_without_async_dp_or_on_an_ffn_server_vllm_keeps_dp_lockstep(engine_config):
    cfg = engine_config({"role": "attention", "num_attention_ranks": 2}, data_parallel_size=2)
    assert cfg.model_config.is_moe is True and cfg.parallel_config.is_moe_model is True
    ffn = engine_config(
        {"role": "ffn", "num_ffn_ranks": 2, "num_attention_ranks": 2, "async_dp": True},
        data_parallel_size=2,
    )
    assert ffn.model_config.is_moe is True  # an expert group: its MoE layers need lockstep


def test_a_server_spanning_hosts_marks_its_ranks_for_its_processes(engine_config, monkeypatch):
    """Its ranks share their metrics through the rendezvous store (metrics.SnapshotShare):
    the mark says which, and it is made before async DP makes each engine's config DP size
    1; a server on one host makes none."""
    from afd_core import envs

    monkeypatch.delenv(envs.AFD_SERVER_RANKS, raising=False)
    engine_config({"role": "attention", "num_attention_ranks": 2}, data_parallel_size=2)
    assert envs.server_ranks() is None
    for afd, ranks in (
        ({"role": "attention", "num_attention_ranks": 4, "start_rank": 2}, [2, 3]),
        ({"role": "attention", "num_attention_ranks": 2, "async_dp": True}, [0, 1]),
        ({"role": "ffn", "num_ffn_ranks": 2, "num_attention_ranks": 2}, [0, 1]),
    ):
        monkeypatch.delenv(envs.AFD_SERVER_RANKS, raising=False)
        # the head host's flags: one of the two data-parallel ranks here, one elsewhere
        engine_config(afd, data_parallel_size=2, data_parallel_size_local=1)
        assert envs.server_ranks() == ranks, afd


EXAMPLE_CONSUMER = {"kv_connector": "ExampleConnector", "kv_role": "kv_consumer"}


def test_an_attention_server_may_be_a_kv_consumer(engine_config):
    """The decode stage of a prefill/decode deployment (docs/pd.md)."""
    from vllm.config import KVTransferConfig

    cfg = engine_config(
        {"role": "attention"}, kv_transfer_config=KVTransferConfig(**EXAMPLE_CONSUMER)
    )
    assert cfg.parallel_config.worker_cls.endswith("AFDCPUAttentionWorker")
    assert cfg.kv_transfer_config.is_kv_consumer


@pytest.mark.parametrize(
    "kw,flag",
    [
        ({"kv_transfer_config": EXAMPLE_CONSUMER}, "--kv-transfer-config"),
        (
            {"kv_transfer_config": {**EXAMPLE_CONSUMER, "kv_role": "kv_both"}},
            "--kv-transfer-config",
        ),
        ({"kv_offloading_size": 1.0}, "--kv-offloading-size"),
    ],
)
def test_an_ffn_server_refuses_kv_transfer_naming_the_flag_and_where_it_goes(
    engine_config, kw, flag
):
    from vllm.config import KVTransferConfig

    if "kv_transfer_config" in kw:
        kw = {"kv_transfer_config": KVTransferConfig(**kw["kv_transfer_config"])}
    with pytest.raises(
        Exception, match=rf"{flag} on an FFN server: an FFN server holds no KV cache"
    ) as err:
        engine_config({"role": "ffn"}, **kw)
    assert f"allowed: give {flag} to the attention servers" in str(err.value)
