"""DeepSeek-V4 tensor names: the public checkpoint's spelling <-> afdserve's module names.

Public checkpoints (and transformers' `save_pretrained`, which writes them back) say
`layers.3.attn.wq_a.weight`, `layers.3.ffn.experts.7.w1.weight`, `hc_head_fn`, `embed.weight`,
`head.weight`, with or without a leading `model.`. afdserve's modules are named like the other
families' (`model.layers.3.self_attn.q_a_proj.weight`, `model.layers.3.mlp.gate.weight`), so the
FFN half is the same MoE block every family uses and the loader stacks the experts as usual.

A quantized checkpoint (DeepSeek-V4-Flash) stores each FP8 or FP4 weight's scales beside it as
`<module>.scale` (`layers.3.attn.wq_a.scale`, `layers.3.ffn.experts.7.w1.scale`); ours, as for
every family, is `<module>.weight_scale_inv` (transformers renames them the same way).
"""

from __future__ import annotations

import re

# Inside one layer: public -> ours. Longest first, so `attn.indexer.compressor.` wins over
# `attn.indexer.` and `attn.compressor.`.
_LAYER = (
    ("attn.indexer.compressor.wkv.", "self_attn.compressor.indexer.kv_proj."),
    ("attn.indexer.compressor.wgate.", "self_attn.compressor.indexer.gate_proj."),
    ("attn.indexer.compressor.norm.", "self_attn.compressor.indexer.kv_norm."),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.wq_b.", "self_attn.compressor.indexer.q_b_proj."),
    ("attn.indexer.weights_proj.", "self_attn.compressor.indexer.weights_proj."),
    ("attn.compressor.wkv.", "self_attn.compressor.kv_proj."),
    ("attn.compressor.wgate.", "self_attn.compressor.gate_proj."),
    ("attn.compressor.norm.", "self_attn.compressor.kv_norm."),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.wq_a.", "self_attn.q_a_proj."),
    ("attn.q_norm.", "self_attn.q_a_norm."),
    ("attn.wq_b.", "self_attn.q_b_proj."),
    ("attn.wkv.", "self_attn.kv_proj."),
    ("attn.norm.", "self_attn.kv_norm."),
    ("attn.wo_a.", "self_attn.o_a_proj."),
    ("attn.wo_b.", "self_attn.o_b_proj."),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn_norm.", "input_layernorm."),
    ("ffn_norm.", "post_attention_layernorm."),
    ("hc_attn_fn", "attn_hc.fn"),
    ("hc_attn_base", "attn_hc.base"),
    ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"),
    ("hc_ffn_base", "ffn_hc.base"),
    ("hc_ffn_scale", "ffn_hc.scale"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.", "mlp.gate."),
    ("ffn.shared_experts.w1.", "mlp.shared_experts.gate_proj."),
    ("ffn.shared_experts.w3.", "mlp.shared_experts.up_proj."),
    ("ffn.shared_experts.w2.", "mlp.shared_experts.down_proj."),
    ("ffn.experts.", "mlp.experts."),  # per-expert w1/w2/w3: the loader's usual stacking
)
_TOP = (
    ("embed.weight", "model.embed_tokens.weight"),
    ("embed_tokens.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("norm.weight", "model.norm.weight"),
    ("hc_head_fn", "model.hc_head.fn"),
    ("hc_head_base", "model.hc_head.base"),
    ("hc_head_scale", "model.hc_head.scale"),
    ("hc_head.hc_fn", "model.hc_head.fn"),
    ("hc_head.hc_base", "model.hc_head.base"),
    ("hc_head.hc_scale", "model.hc_head.scale"),
)
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.*)$")
# `.scale` of a quantized projection; mHC's own `scale` (`hc_attn_scale`, or transformers'
# `attn_hc.scale`) is no weight's scale.
_PUBLIC_SCALE = re.compile(r"^(.*)\.scale$")
_MHC_MODULES = ("attn_hc", "ffn_hc", "hc_head")
OUR_SCALE = "_scale_inv"


def to_ours(name: str) -> str:
    """A public checkpoint name (or transformers' module name) -> our module's tensor name; a
    name we do not know comes back as it was (the loader reports it as unexpected, e.g. the MTP
    layers' `mtp.*`)."""
    bare = name[len("model.") :] if name.startswith("model.") else name
    scale = _PUBLIC_SCALE.match(bare)
    if scale is not None and scale.group(1).rsplit(".", 1)[-1] not in _MHC_MODULES:
        return to_ours(scale.group(1) + ".weight") + OUR_SCALE
    for public, ours in _TOP:
        if bare == public:
            return ours
    m = _LAYER_NAME.match(bare)
    if m is None:
        return name
    layer, rest = m.groups()
    for public, ours in _LAYER:
        if rest.startswith(public):
            return f"model.layers.{layer}.{ours}{rest[len(public) :]}"
    # transformers' own module names are ours but for the indexer's scoring head.
    return f"model.layers.{layer}.{rest.replace('.indexer.scorer.', '.indexer.')}"


def to_public(name: str) -> str:
    """Our tensor name -> the public spelling (for messages about missing tensors)."""
    if name.endswith(".weight" + OUR_SCALE):
        return to_public(name.removesuffix(OUR_SCALE)).removesuffix(".weight") + ".scale"
    for public, ours in _TOP:
        if name == ours and "." not in public.replace(".weight", ""):
            return public
    m = re.match(r"^model\.layers\.(\d+)\.(.*)$", name)
    if m is None:
        return name
    layer, rest = m.groups()
    for public, ours in _LAYER:
        if rest.startswith(ours):
            return f"layers.{layer}.{public}{rest[len(ours) :]}"
    return name
