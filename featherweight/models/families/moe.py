"""Mixture-of-experts families (`models/moe.py`): Qwen3-MoE (Qwen3's attention with QK-norm;
`num_experts` experts of `moe_intermediate_size`, top-k renormalized when `norm_topk_prob`) and
Mixtral (Mistral's attention; `num_local_experts`, top-k always renormalized). Every layer is an
MoE layer; a checkpoint with dense layers among them (`mlp_only_layers`, `decoder_sparse_step`
> 1) is refused."""

from __future__ import annotations

from typing import Any

from featherweight.errors import ExportError, ModelConfigError, UnsupportedModelError
from featherweight.models.families.base import Family, GGUFGet, HFConfig
from featherweight.models.families.llama import _mistral_options, _window_extras
from featherweight.models.families.qwen3 import QWEN3


def _every_layer_sparse(hf: HFConfig, source: str) -> None:
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedModelError(
            f"{source}: dense MLP layers among the experts (mlp_only_layers="
            f"{hf.get('mlp_only_layers')}, decoder_sparse_step={hf.get('decoder_sparse_step')}) "
            "are not supported; every layer must be a mixture-of-experts layer"
        )


def _experts(hf: HFConfig, width_field: str, norm_topk: bool) -> dict[str, Any]:
    """The expert fields: the count is `num_experts` (Qwen3-MoE on the Hub) or
    `num_local_experts` (Mixtral, and transformers 5's spelling for both)."""
    coef = hf.get("router_aux_loss_coef")
    count = hf.get("num_local_experts", hf.get("num_experts"))
    if count is None:
        raise ModelConfigError(
            "config.json lacks num_experts (or num_local_experts); copy the model's original "
            "config.json"
        )
    return {
        "num_experts": int(count),
        "experts_per_token": int(hf["num_experts_per_tok"]),
        "intermediate_size": int(hf[width_field]),
        "norm_topk_prob": norm_topk,
        "router_aux_loss_coef": None if coef is None else float(coef),
        "output_router_logits": bool(hf.get("output_router_logits", False)),
    }


def _qwen3_moe_options(hf: HFConfig, source: str) -> dict[str, Any]:
    _every_layer_sparse(hf, source)
    experts = _experts(hf, "moe_intermediate_size", bool(hf.get("norm_topk_prob")))
    return {**QWEN3.layer_options(hf, source), **experts}


def _mixtral_options(hf: HFConfig, source: str) -> dict[str, Any]:
    return {
        **_mistral_options(hf, source),
        **_experts(hf, "intermediate_size", True),
    }


def _qwen3_moe_extras(config: Any) -> dict[str, Any]:
    return {
        **QWEN3.hf_extras(config),
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.experts_per_token,
        "moe_intermediate_size": config.intermediate_size,
        "norm_topk_prob": config.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": config.router_aux_loss_coef or 0.001,
    }


def _qwen3_moe_gguf_metadata(config: Any) -> dict[str, Any]:
    """llama.cpp's qwen3moe always renormalizes the top-k weights (the expert keys themselves
    are written for every MoE: `gguf_writer.add_hyperparameters`)."""
    if not config.norm_topk_prob:
        raise ExportError(
            "llama.cpp's qwen3moe renormalizes each token's top-k expert weights, and this model "
            "does not (norm_topk_prob=false); export it as Hugging Face weights (--format merged)"
        )
    return QWEN3.gguf_metadata(config)


def _qwen3_moe_gguf_options(get: GGUFGet, shape: dict[str, int]) -> dict[str, Any]:
    return {**QWEN3.gguf_options(get, shape), "norm_topk_prob": True}


def _mixtral_extras(config: Any) -> dict[str, Any]:
    return {
        **_window_extras(config),
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.experts_per_token,
        "router_aux_loss_coef": config.router_aux_loss_coef or 0.001,
    }


QWEN3_MOE = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    architecture="Qwen3MoeForCausalLM",
    gguf_architecture="qwen3moe",
    defaults={"intermediate_size": 6144},
    layer_options=_qwen3_moe_options,
    hf_extras=_qwen3_moe_extras,
    hf_layer_names={
        **QWEN3.hf_layer_names,
        "router": "mlp.gate.weight",
        "gate": "mlp.experts.{e}.gate_proj.weight",
        "up": "mlp.experts.{e}.up_proj.weight",
        "down": "mlp.experts.{e}.down_proj.weight",
    },
    gguf_layer_names={
        **QWEN3.gguf_layer_names,
        "router": "ffn_gate_inp.weight",
        "gate": "ffn_gate_exps.weight",
        "up": "ffn_up_exps.weight",
        "down": "ffn_down_exps.weight",
    },
    gguf_options=_qwen3_moe_gguf_options,
    gguf_metadata=_qwen3_moe_gguf_metadata,
)
MIXTRAL = Family(
    name="mixtral",
    model_types=("mixtral",),
    architecture="MixtralForCausalLM",
    gguf_architecture="llama",
    layer_options=_mixtral_options,
    hf_extras=_mixtral_extras,
    hf_layer_names={
        "router": "block_sparse_moe.gate.weight",
        "gate": "block_sparse_moe.experts.{e}.w1.weight",
        "up": "block_sparse_moe.experts.{e}.w3.weight",
        "down": "block_sparse_moe.experts.{e}.w2.weight",
    },
    gguf_layer_names={
        "router": "ffn_gate_inp.weight",
        "gate": "ffn_gate_exps.weight",
        "up": "ffn_up_exps.weight",
        "down": "ffn_down_exps.weight",
    },
    gguf_permutes_qk=True,
)
