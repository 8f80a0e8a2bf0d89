"""The offline API: `LLM(model, topology=...)` and `LLM.generate(prompts, SamplingParams(...))`.

It sits on top: it picks the one-process engine (colocated, in-process 1A1F) or starts one process
per rank (afd/launcher.py), and drives either through the same EngineClient interface."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import tempfile
from collections.abc import Sequence

from afdserve.afd.launcher import ProcessClient
from afdserve.afd.local import SingleProcessClient
from afdserve.afd.messages import RankReady, WorkerSpec
from afdserve.config import AFDConfig, EngineConfig, GraphConfig
from afdserve.engine.client import EngineClient
from afdserve.engine.engine_core import RequestOutput
from afdserve.engine.factory import load_tokenizer
from afdserve.engine.sampling_params import SamplingParams
from afdserve.layout.experts import resolve_placement
from afdserve.model.bundled import resolve_model
from afdserve.model.config import load_model_config

Prompt = str | list[int]
log = logging.getLogger(__name__)


def _parse_address(text: str | None) -> tuple[str, int] | None:
    if text is None:
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"frontend_address={text!r}: expected HOST:PORT, e.g. 0.0.0.0:5555")
    return host or "0.0.0.0", int(port)


class LLM:
    """Runs colocated in this process, or starts every rank of an AFD topology as a process.

    Use as a context manager (or call `shutdown()`) so that every rank process is stopped.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        topology: str = "colocated",
        device: str = "cpu",
        dtype: str = "auto",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        kv_cache_blocks: int | None = None,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.85,
        graph_mode: str = "none",
        cuda_graph_sizes: Sequence[int] | None = None,
        ubatches: int = 1,
        gate_on_attention: bool = False,
        log_step_plan: bool | str = False,
        log_data_plane: str | None = None,
        connector: str = "auto",
        frontend_address: str | None = None,
        seed: int = 0,
        ffn_expert_parallel: bool = False,
        expert_placement: Sequence[Sequence[int]] | None = None,
    ) -> None:
        # The bundled model is served under a short name (its path is a cache detail).
        self.model_name = "afdserve-tiny" if model in (None, "", "tiny") else str(model)
        model = resolve_model(model)
        self.engine_config = EngineConfig(
            model=model,
            device=device,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            kv_cache_blocks=kv_cache_blocks,
            block_size=block_size,
            gpu_memory_utilization=float(gpu_memory_utilization),
            seed=seed,
        )
        self.afd_config = AFDConfig(
            topology=topology,
            ubatches=ubatches,
            gate_on_attention=gate_on_attention,
            log_step_plan=log_step_plan,
            connector=connector,
            log_data_plane=log_data_plane,
            ffn_expert_parallel=ffn_expert_parallel,
            expert_placement=expert_placement,
        )
        sizes = tuple(cuda_graph_sizes) if cuda_graph_sizes is not None else None
        self.graph_config = GraphConfig(mode=graph_mode, sizes=sizes)
        self.topology = self.afd_config.parsed_topology
        if ffn_expert_parallel:
            # Checked against the model's experts here, before any rank process starts.
            self.expert_placement = resolve_placement(
                self.afd_config.expert_placement, load_model_config(model).num_experts,
                self.topology.ffn_ranks)
        self._log_path = self._step_log_path(log_step_plan)
        self._frontend_address = _parse_address(frontend_address)
        self._ids = itertools.count()
        self.tokenizer = load_tokenizer(model)
        self.engine: EngineClient = self._start()

    def _step_log_path(self, log_step_plan: bool | str) -> str | None:
        """A path the caller named is theirs to keep; a temporary one (log_step_plan=True) is
        read into memory and removed at shutdown."""
        self._own_log = log_step_plan is True
        self._closed_log: list[dict] | None = None
        if log_step_plan is True:
            fd, path = tempfile.mkstemp(prefix="afdserve-step-plan-", suffix=".jsonl")
            os.close(fd)
            return path
        return log_step_plan or None

    def _start(self) -> EngineClient:
        spec = WorkerSpec(self.engine_config, self.afd_config, self.graph_config, self._log_path)
        if self.topology.colocated or self.afd_config.in_process(self.engine_config.device):
            if self.topology.attention_ranks == 1:
                client: EngineClient = SingleProcessClient(spec)
                self._describe(client.ready)
                return client
        if self._frontend_address is None:
            client = ProcessClient(spec)
        else:  # ranks are started elsewhere (torchrun, Slurm) and connect here
            client = ProcessClient(spec, spawn=False, frontend_address=self._frontend_address)
        self.frontend_address = client.address
        self._describe(client.ready)
        return client

    def _describe(self, ready: dict[int, RankReady]) -> None:
        self.memory_reports = [ready[r].memory for r in sorted(ready)]
        self.rank_tensor_names = {r: list(ready[r].tensor_names) for r in ready}

    # ----- generation -----
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in prompt order; every prompt is checked first."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(
                f"sampling_params: {len(params)} given for {len(prompts)} prompts "
                "(one, or one each)"
            )
        encoded = [self.encode(p) for p in prompts]
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for request_id, tokens, p in zip(ids, encoded, params):
            try:
                self.engine.add_request(request_id, tokens, p)
            except Exception:
                for earlier in ids[: ids.index(request_id)]:
                    self.engine.abort(earlier)
                raise
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def step_log(self) -> list[dict]:
        """Every rank's step-plan records (needs log_step_plan)."""
        if self._closed_log is not None:
            return list(self._closed_log)
        if self._log_path is None:
            return []
        with open(self._log_path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def shutdown(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        if getattr(self, "_own_log", False) and self._closed_log is None:
            self._closed_log = self.step_log()  # every rank has stopped writing
            with contextlib.suppress(OSError):
                os.remove(self._log_path)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
