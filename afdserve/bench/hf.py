"""The `transformers` baseline of `afdserve bench decode --compare-hf`: the same config with the
very weight tensors afdserve holds, timed through `generate`."""

from __future__ import annotations

import torch

from afdserve.bench.decode_steps import DecodeSpec
from afdserve.bench.report import device_seconds
from afdserve.model.parts import CausalLM


def hf_sharing_weights(
    attn: CausalLM, ffn: CausalLM, raw: dict, dtype: torch.dtype, device: torch.device
) -> torch.nn.Module:
    """The transformers model of the same config, its parameters the very tensors afdserve holds
    (no second copy of the weights: a 30B model fits once, not twice)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    state = {**attn.state_dict(), **ffn.state_dict()}
    hf.load_state_dict(state, strict=False, assign=True)
    rotary = getattr(hf.model, "rotary_emb", None)
    if rotary is not None:  # non-persistent buffers are not in any state dict
        hf.model.rotary_emb = type(rotary)(config=hf.config).to(device)
    left = [n for n, t in (*hf.named_parameters(), *hf.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"transformers model has tensors afdserve does not: {left[:10]}")
    return hf.eval()


@torch.inference_mode()
def hf_tokens_per_s(hf: torch.nn.Module, spec: DecodeSpec, batch: int) -> float:
    """Decode tokens/s of `generate` at the same batch and context: (time for `steps` new tokens
    - time for 1) / (steps - 1), so the prefill both runs share cancels out."""
    dev = next(hf.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(spec.seed + 2)
    vocab = hf.config.vocab_size
    prompt = torch.randint(0, vocab, (batch, spec.context_len), device=dev, generator=gen)
    mask = torch.ones_like(prompt)

    def generate(new_tokens: int) -> None:
        hf.generate(
            input_ids=prompt,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )

    generate(2)  # warm-up
    one = device_seconds(lambda: generate(1), dev)
    many = device_seconds(lambda: generate(spec.steps), dev)
    return batch * (spec.steps - 1) / max(many - one, 1e-9)
