"""The one-process engine: colocated (the correctness reference and the speed baseline), or
in-process 1A1F with the FFN half behind an InProcessConnector. It steps the same attention driver
as a rank process, with a control plane of one."""

from __future__ import annotations

import gc
from collections import Counter

import torch

from afdserve.afd.ranks.build import build_attention_rank
from afdserve.afd.ranks.messages import RankReady, WorkerSpec
from afdserve.engine.control_round import LocalControl
from afdserve.engine.device import resolve_device
from afdserve.engine.requests import TokenDelta
from afdserve.engine.sampling_params import SamplingParams
from afdserve.frontend.core_client import EngineCoreClient, EngineStats, cache_config_labels


class SingleProcessClient(EngineCoreClient):
    def __init__(self, spec: WorkerSpec) -> None:
        device = torch.device(resolve_device(spec.engine.device))
        in_process = not spec.topology.colocated
        built = build_attention_rank(spec, 0, device, LocalControl(), in_process=in_process)
        self.core, self.driver = built.core, built.driver
        self.ready: dict[int, RankReady] = {r.rank: r for r in built.ready}
        self.max_model_len = self.core.max_model_len
        self.vocab_size = self.core.config.vocab_size
        self.limits = self.core.limits
        self.driver.warmup()
        self.cache_config = cache_config_labels(
            self.limits, spec.engine.kv_cache_dtype, self.core.block_manager.prefix_caching
        )
        self.iteration_tokens: Counter[int] = Counter()

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | tuple[int, ...] = (),
    ) -> None:
        self.core.add_request(request_id, prompt_token_ids, params, output_token_ids)

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    def step(self) -> list[TokenDelta]:
        outputs = self.driver.step().outputs
        self.iteration_tokens.update(self.driver.meter.drain())
        return outputs

    @property
    def has_unfinished(self) -> bool:
        return self.core.has_unfinished

    def stats(self) -> EngineStats:
        s, blocks = self.core.scheduler, self.core.block_manager
        return EngineStats(
            running=s.num_running,
            waiting=s.num_waiting,
            kv_cache_usage=blocks.usage,
            steps=dict(self.driver.recorder.mode_counts),
            prefix_cache_queries={0: blocks.queried_tokens},
            prefix_cache_hits={0: blocks.hit_tokens},
            preemptions={0: s.num_preemptions},
            scheduled_tokens={0: self.driver.meter.scheduled_tokens},
            forward_s={0: self.driver.meter.forward_s},
            wait_s={0: 0.0},  # nothing crosses a wire: the FFN half runs inline
            a2e_bytes={0: 0},
            e2a_bytes={0: 0},
            iteration_tokens=dict(self.iteration_tokens),
            cache_config=self.cache_config,
            spec_decode={0: drafter.stats} if (drafter := self.core.drafter) else {},
        )

    def step_log(self) -> list[dict]:
        return list(self.driver.recorder.records)

    def shutdown(self) -> None:
        """Release the model, the KV cache and any graphs so the next engine gets the memory."""
        if self.driver is None:
            return
        self.driver.recorder.close()
        cuda = self.core.device.type == "cuda"
        self.core = self.driver = None
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
