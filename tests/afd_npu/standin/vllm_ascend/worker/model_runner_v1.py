"""Stand-in of vllm_ascend/worker/model_runner_v1.py: NPUModelRunner subclasses vLLM's real
GPUModelRunner and overrides the methods AFD's runner mixin overrides, with vllm-ascend
0.23's signatures (the bodies are not Ascend's: nothing here runs a model)."""

from vllm.v1.worker.gpu_model_runner import GPUModelRunner


class NPUModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device):
        self.vllm_config = vllm_config
        self.device = device

    def get_model(self):
        return self.model

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        raise NotImplementedError("stand-in")

    def _determine_batch_execution_and_padding(
        self,
        num_tokens,
        num_reqs,
        num_scheduled_tokens_np,
        max_num_scheduled_tokens,
        use_cascade_attn,
        allow_microbatching=False,
        force_eager=False,
        force_uniform_decode=None,
        force_has_lora=None,
        force_num_active_loras=None,
        num_encoder_reqs=0,
    ):
        raise NotImplementedError("stand-in")

    def _build_attention_metadata(
        self,
        num_tokens,
        num_reqs,
        max_query_len,
        num_tokens_padded=None,
        num_reqs_padded=None,
        ubatch_slices=None,
        logits_indices=None,
        use_spec_decode=False,
        for_cudagraph_capture=False,
        num_scheduled_tokens=None,
        num_scheduled_tokens_np=None,
        cascade_attn_prefix_lens=None,
    ):
        raise NotImplementedError("stand-in")

    def _dummy_run(
        self,
        num_tokens,
        with_prefill=False,
        cudagraph_runtime_mode=None,
        force_attention=False,
        uniform_decode=False,
        is_profile=False,
        create_mixed_batch=False,
        allow_microbatching=True,
        skip_eplb=False,
        remove_lora=True,
        is_graph_capturing=False,
        num_active_loras=0,
        profile_seq_lens=None,
        profile_cpp=False,
    ):
        raise NotImplementedError("stand-in")
