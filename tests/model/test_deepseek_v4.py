"""DeepSeek-V4's attention half with mHC, whole-sequence (prefill) form, against transformers'
modules of the same tiny checkpoint (float32; a window of 4, CSA rate 2 with an indexer keeping 2,
HCA rate 4, so prompts of a few tokens cross all of them): layer by layer on the activations
transformers itself produced, then the whole model's logits and greedy tokens. Also the loader:
public names in either spelling, and one-line refusals of broken checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4ForCausalLM

from afdserve.model.checkpoint.loader import CheckpointError, load_model
from afdserve.model.families.deepseek_v4 import names
from afdserve.model.families.deepseek_v4.model import V4CausalLM
from afdserve.model.fixtures.byte_tokenizer import VOCAB_SIZE
from afdserve.model.fixtures.tiny import make_tiny_model
from afdserve.model.parts import ModelParts
from tests.model.deepseek_v4_helpers import boundary_ties

# Lengths below, at and past the window (4) and every compression boundary (2, 4).
LENGTHS = (1, 2, 3, 4, 5, 7, 8, 9, 13, 29)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("v4") / "tiny", "deepseek_v4", hash_layers=1)


@pytest.fixture(scope="module")
def hf(v4_dir: Path) -> DeepseekV4ForCausalLM:
    return DeepseekV4ForCausalLM.from_pretrained(
        v4_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def ours(v4_dir: Path) -> V4CausalLM:
    model, report = load_model(v4_dir, ModelParts.colocated(), "float32")
    assert report.unexpected == []
    return model


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed))


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    """|got - want| <= tol * max|want|: float32 with sums taken in another order."""
    torch.testing.assert_close(got, want, atol=tol * float(want.abs().max()), rtol=0.0)


def capture(hf: DeepseekV4ForCausalLM, ids: torch.Tensor) -> dict[str, tuple]:
    """Every hooked module's (args, output) in transformers' own full forward."""
    seen: dict[str, tuple] = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        for part in ("attn_hc", "self_attn", "ffn_hc", "mlp"):

            def hook(module, args, kwargs, output, key=f"{i}.{part}"):
                seen[key] = (args, kwargs, output)

            hooks.append(getattr(layer, part).register_forward_hook(hook, with_kwargs=True))
    with torch.no_grad():
        logits = hf(ids[None], use_cache=False).logits[0]
    for h in hooks:
        h.remove()
    seen["logits"] = ((), {}, logits)
    return seen


@pytest.mark.parametrize("length", [5, 13])
@torch.inference_mode()
def test_each_layer_equals_transformers_modules(
    hf: DeepseekV4ForCausalLM, ours: V4CausalLM, length: int
) -> None:
    ids = prompt(length, seed=length)
    seen = capture(hf, ids)
    positions = torch.arange(length)
    ropes = ours.ropes("cpu")
    for i, block in enumerate(ours.model.layers):
        for part in ("attn_hc", "ffn_hc"):  # mHC: collapse, post, comb (Sinkhorn)
            args, _, (post, comb, collapsed) = seen[f"{i}.{part}"]
            got = getattr(block, part)(args[0][0])
            close(got[0], collapsed[0], 1e-6)
            close(got[1], post[0], 1e-6)
            close(got[2], comb[0], 1e-6)
            assert torch.allclose(got[2].sum(-2), torch.ones(()), atol=1e-5)  # columns sum to 1
        args, _, (want, _) = seen[f"{i}.self_attn"]
        attn = block.self_attn
        own = ropes["main"] if attn.kind == "sliding_attention" else ropes["compress"]
        close(attn(args[0][0], positions, own, ropes["compress"])[0], want[0])
        args, kwargs, want = seen[f"{i}.mlp"]
        close(ours.ffn_half(i, args[0][0], kwargs["input_ids"][0]), want[0], 1e-6)


@torch.inference_mode()
def test_compressors_and_indexer_equal_transformers(
    hf: DeepseekV4ForCausalLM, ours: V4CausalLM
) -> None:
    length = 13
    x = torch.randn(length, hf.config.hidden_size, generator=torch.Generator().manual_seed(5))
    positions = torch.arange(length)
    rope = ours.ropes("cpu")["compress"]
    for i, block in enumerate(ours.model.layers):
        mine = block.self_attn.compressor
        if mine is None:
            continue
        theirs = hf.model.layers[i].self_attn.compressor
        q_residual = hf.model.layers[i].self_attn.q_a_norm(hf.model.layers[i].self_attn.q_a_proj(x))
        entries, bias = theirs(x[None], q_residual[None], positions[None], None, i)
        close(mine.extend(x, None, rope).entries, entries[0, 0], 1e-6)
        if block.self_attn.kind == "compressed_sparse_attention":
            chosen, _ = mine.indexer.select(x, q_residual, positions, rope, None)
            assert torch.equal(chosen, bias[0, 0] == 0)
            assert int(chosen.sum(-1).max()) == hf.config.index_topk  # the indexer does choose


@pytest.mark.parametrize("length", LENGTHS)
@torch.inference_mode()
def test_full_forward_matches_transformers(
    hf: DeepseekV4ForCausalLM, ours: V4CausalLM, length: int
) -> None:
    ids = prompt(length, seed=100 + length)
    assert boundary_ties(ours, ids) == []  # else the kept entries are torch.topk's choice
    want = hf(ids[None], use_cache=False).logits[0]
    got = ours.forward_full(ids)
    close(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@torch.inference_mode()
def test_greedy_tokens_match_transformers_full_forward(
    hf: DeepseekV4ForCausalLM, ours: V4CausalLM
) -> None:
    # transformers' full forward is the definition (its cached generate disagrees with it on
    # these shapes), so both sides re-run the whole sequence for every new token.
    for seed, length in ((1, 3), (2, 6)):
        theirs = mine = prompt(length, seed)
        for _ in range(NEW_TOKENS):
            nxt = hf(theirs[None], use_cache=False).logits[0, -1].argmax()
            theirs = torch.cat((theirs, nxt[None]))
            mine = torch.cat((mine, ours.forward_full(mine)[-1].argmax()[None]))
        assert mine.tolist() == theirs.tolist()
        assert boundary_ties(ours, mine) == []


@torch.inference_mode()
def test_split_halves_equal_colocated(v4_dir: Path, ours: V4CausalLM) -> None:
    """The attention half and the FFN half loaded apart, the FFN reached only through what crosses
    the AFD boundary (the collapsed normed rows and token ids), give the colocated logits."""
    attention, a_report = load_model(v4_dir, ModelParts(attention=True, ffn=False), "float32")
    ffn, f_report = load_model(v4_dir, ModelParts(attention=False, ffn=True), "float32")
    assert not any(".ffn." in n for n in a_report.loaded)
    assert all(".ffn." in n for n in f_report.loaded)
    crossed = []

    def boundary(layer: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        crossed.append(tuple(x.shape))
        return ffn.ffn_half(layer, x, ids)

    ids = prompt(13, seed=9)
    assert torch.equal(attention.forward_full(ids, ffn=boundary), ours.forward_full(ids))
    assert crossed == [(13, ours.config.hidden_size)] * ours.config.num_layers


def rewrite(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        if file.suffix != ".safetensors":
            (dst / file.name).write_bytes(file.read_bytes())
    weights = edit(load_file(src / "model.safetensors"))
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@torch.inference_mode()
def test_public_checkpoint_spelling_loads(v4_dir: Path, ours: V4CausalLM, tmp_path: Path) -> None:
    # DeepSeek's own files say `embed.weight`, `layers.0.attn...`, `hc_head_fn`: no `model.`.
    top = {
        "model.embed_tokens.weight": "embed.weight",
        "model.hc_head.hc_fn": "hc_head_fn",
        "model.hc_head.hc_base": "hc_head_base",
        "model.hc_head.hc_scale": "hc_head_scale",
    }

    def public(weights):
        return {top.get(k, k.removeprefix("model.")): v for k, v in weights.items()}

    path = rewrite(v4_dir, tmp_path / "public", public)
    model, report = load_model(path, ModelParts.colocated(), "float32")
    assert report.unexpected == []
    ids = prompt(9, seed=4)
    assert torch.equal(model.forward_full(ids), ours.forward_full(ids))
    for name in ours.expected_tensors():
        assert names.to_ours(names.to_public(name)) == name, name


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda w: {k: v for k, v in w.items() if k != "model.layers.2.attn.compressor.ape"},
            r"missing tensors: layers\.2\.attn\.compressor\.ape$",
        ),
        (
            lambda w: {k: v for k, v in w.items() if k != "model.layers.1.ffn.experts.3.w3.weight"},
            r"missing tensors: layers\.1\.ffn\.experts\.3\.w3\.weight$",
        ),
        (
            lambda w: {
                **w,
                "model.layers.0.ffn.gate.tid2eid": w["model.layers.0.ffn.gate.tid2eid"][:-1],
            },
            rf"tid2eid: {VOCAB_SIZE - 1} rows, fewer than vocab_size={VOCAB_SIZE}",
        ),
        (
            lambda w: {
                **w,
                "model.layers.0.ffn.gate.tid2eid": w["model.layers.0.ffn.gate.tid2eid"].index_fill(
                    0, torch.tensor([5]), 4
                ),
            },
            r"tid2eid holds expert id 4, outside \[0, 4\)",
        ),
    ],
)
def test_broken_checkpoint_is_refused_in_one_line(
    v4_dir: Path, tmp_path: Path, edit, message: str
) -> None:
    path = rewrite(v4_dir, tmp_path / "broken", edit)
    with pytest.raises(CheckpointError, match=message) as err:
        load_model(path, ModelParts.colocated(), "float32")
    assert "\n" not in str(err.value)


@torch.inference_mode()
def test_bfloat16_keeps_transformers_float32_tensors(v4_dir: Path, ours: V4CausalLM) -> None:
    hf16 = DeepseekV4ForCausalLM.from_pretrained(
        v4_dir, dtype=torch.bfloat16, attn_implementation="eager"
    )
    theirs = {
        n.replace("hc_head.hc_", "hc_head.")
        for n, p in hf16.named_parameters()
        if p.dtype == torch.float32
    }
    model, _ = load_model(v4_dir, ModelParts.colocated(), "bfloat16")
    mine = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert mine == theirs and len(mine) > 50
    ids = prompt(13, seed=3)
    # Measured: bf16 ours and bf16 transformers are each 2-5% (of the largest logit) from
    # float32, and from each other by as much (the router and GEMMs round differently).
    close(model.forward_full(ids), ours.forward_full(ids), 0.1)


@torch.inference_mode()
def test_dummy_weights_agree_across_halves(v4_dir: Path) -> None:
    """load_format="dummy" (benchmarks at real sizes): every half draws the same values."""
    full, _ = load_model(v4_dir, ModelParts.colocated(), "float32", load_format="dummy")
    attention, _ = load_model(v4_dir, ModelParts(True, False), "float32", load_format="dummy")
    ffn, _ = load_model(v4_dir, ModelParts(False, True), "float32", load_format="dummy")
    ids = prompt(20, seed=6)
    want = full.forward_full(ids)
    assert torch.isfinite(want).all()
    assert torch.equal(attention.forward_full(ids, ffn=ffn.ffn_half), want)


@torch.inference_mode()
def test_transformers_module_names_load(
    v4_dir: Path, hf: DeepseekV4ForCausalLM, ours: V4CausalLM, tmp_path: Path
) -> None:
    # A checkpoint written from transformers' state dict as is: stacked experts, its own names.
    path = rewrite(
        v4_dir,
        tmp_path / "internal",
        lambda _: {k: v.contiguous() for k, v in hf.state_dict().items()},
    )
    model, report = load_model(path, ModelParts.colocated(), "float32")
    assert report.unexpected == []
    ids = prompt(9, seed=4)
    assert torch.equal(model.forward_full(ids), ours.forward_full(ids))


def test_make_tiny_model_cli_writes_a_v4_with_a_hash_layer(tmp_path: Path) -> None:
    import json

    from afdserve.cli import main

    assert main(["make-tiny-model", str(tmp_path / "v4"), "--family", "deepseek_v4"]) == 0
    raw = json.loads((tmp_path / "v4" / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v4" and raw["mlp_layer_types"][0] == "hash_moe"
    names_on_disk = load_file(tmp_path / "v4" / "model.safetensors").keys()
    assert "model.layers.0.ffn.gate.tid2eid" in names_on_disk  # the public spelling
    assert (
        main(
            [
                "make-tiny-model",
                str(tmp_path / "none"),
                "--family",
                "deepseek_v4",
                "--hash-layers",
                "0",
            ]
        )
        == 0
    )
    raw = json.loads((tmp_path / "none" / "config.json").read_text())
    assert "hash_moe" not in raw["mlp_layer_types"]
