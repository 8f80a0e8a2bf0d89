"""The offline API: `LLM(model, topology=...)` and `LLM.generate(prompts, SamplingParams(...))`.

It sits on top: it picks the one-process engine (colocated, in-process 1A1F) or starts one process
per rank (frontend/process.py), and drives either through the same EngineClient: the frontend,
which turns the core client's token deltas into outputs with this LLM's tokenizer."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Mapping, Sequence

from afdserve.afd.ranks.messages import RankReady, WorkerSpec
from afdserve.config import (
    MTP_IPC_REFUSAL,
    EngineConfig,
    EngineConfigs,
    SpeculativeConfig,
    engine_configs,
)
from afdserve.engine.cuda_graphs import auto_graph_mode, check_capturable
from afdserve.engine.device import resolve_device, with_batch_limits
from afdserve.engine.factory import max_model_len_for, prefix_caching_for, with_block_size
from afdserve.engine.sampling_params import SamplingParams, candidate_params
from afdserve.engine.step_recorder import StepLogFile
from afdserve.engine.tokenizer import load_tokenizer
from afdserve.frontend.client import EngineClient
from afdserve.frontend.core_client import EngineCoreClient
from afdserve.frontend.generation_config import generation_defaults
from afdserve.frontend.outputs import RequestOutput, SequenceOutput, gather
from afdserve.frontend.process import ProcessClient
from afdserve.frontend.single_process import SingleProcessClient
from afdserve.layout.experts import resolve_placement
from afdserve.layout.topology import Topology
from afdserve.model.checkpoint.hub import TOKENIZER_PATTERNS, resolve_model_dir
from afdserve.model.checkpoint.preflight import preflight
from afdserve.model.families import load_model_config
from afdserve.model.quantization import check_quantization

Prompt = str | list[int]
PromptInput = str | list[int] | dict  # dict: {"prompt": str} or {"prompt_token_ids": [...]}
log = logging.getLogger(__name__)


def _parse_address(text: str | None) -> tuple[str, int] | None:
    if text is None:
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"frontend_address={text!r}: expected HOST:PORT, e.g. 0.0.0.0:5555")
    return host or "0.0.0.0", int(port)


def resolve_engine(
    model: str | None, kwargs: Mapping[str, object], spawned: bool = True, usage: str = "llm"
) -> EngineConfigs:
    """The configs as the LLM runs them, every check done before any process starts: the
    keywords checked as given (the configs read no directory), then the model and tokenizer
    made local directories (a hub id: its cached snapshot, downloaded if need be) and, when this
    process spawns the ranks on this host, device and graph mode "auto" resolved (ranks started
    elsewhere resolve them on their own hosts). The batch limits "auto" resolve here either way
    (every rank of a world must agree on them), by `usage` ("llm" or "server") and the GPU
    this process sees."""
    engine, afd, graph = engine_configs(
        {"model": model or "tiny", **kwargs},
        also=("frontend_address", "generation_config", "usage_context"),
    )
    model_dir, tokenizer_dir = resolve_sources(model, engine)
    engine = dataclasses.replace(engine, model=model_dir, tokenizer=tokenizer_dir)
    if spawned:
        engine = dataclasses.replace(engine, device=resolve_device(engine.device))
        afd.check_device(engine.device)
        graph = graph.resolved(engine.device)
        check_replicas(afd.parsed_topology, engine.device)
    check_mtp_connector(engine.speculative_config, afd.connector)
    return EngineConfigs(with_batch_limits(engine, usage), afd, graph)


def check_mtp_connector(speculative: SpeculativeConfig | None, connector: str) -> None:
    """MTP drafts run on every topology, over every connector but "ipc" (`MTP_IPC_REFUSAL`);
    checked as given and again once "auto" is resolved."""
    if speculative is not None and speculative.is_mtp and connector == "ipc":
        raise ValueError(
            f"speculative_config method={speculative.method!r} with connector "
            f"{connector!r}: not supported yet: {MTP_IPC_REFUSAL}"
        )


def check_replicas(topology: Topology, device: str) -> None:
    """Data-parallel replicas on CUDA take one GPU each (as vLLM's): each fills its share of
    its GPU's memory, so two on one GPU would not fit."""
    replicas = topology.attention_ranks
    if not topology.colocated or replicas == 1 or not device.startswith("cuda"):
        return
    gpus = _cuda_devices(device)
    if gpus < replicas:
        raise ValueError(
            f"data_parallel_size={replicas} needs {replicas} GPUs, one per replica; "
            f"this process sees {gpus}"
        )


def resolve_sources(model: str | None, config: EngineConfig) -> tuple[str, str | None]:
    """The local directories of the model and of its tokenizer (None: the model's), each as
    given or a hub id's cached snapshot (model/checkpoint/hub.py)."""
    source = {"download_dir": config.download_dir, "trust_remote_code": config.trust_remote_code}
    model_dir = resolve_model_dir(model, revision=config.revision, **source)
    if config.tokenizer is None:
        return model_dir, None
    tokenizer_dir = resolve_model_dir(
        config.tokenizer, what="tokenizer", patterns=TOKENIZER_PATTERNS, **source
    )
    return model_dir, tokenizer_dir


def _cuda_devices(device: str) -> int:
    if not device.startswith("cuda"):
        return 0
    import torch

    return torch.cuda.device_count()


class LLM:
    """Runs colocated in this process, or starts every rank of an AFD topology as a process.

    Use as a context manager (or call `shutdown()`) so that every rank process is stopped.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        frontend_address: str | None = None,
        generation_config: str = "auto",
        usage_context: str = "llm",
        **kwargs: object,
    ) -> None:
        """`kwargs`: the fields of EngineConfig, AFDConfig and GraphConfig by their keywords
        (topology=, device=, graph_mode=, cuda_graph_sizes=, ...; `afdserve serve --help`
        lists every one with its default). `frontend_address`: HOST:PORT to listen on for
        ranks started elsewhere instead of spawning them; `generation_config`: "auto",
        "vllm" or a directory, the defaults of `get_default_sampling_params()`;
        `usage_context`: "llm", or "server" (`afdserve serve`), whose batch limits "auto"
        differ as vLLM's do."""
        # The bundled model is served under a short name (its path is a cache detail).
        self.model_name = "afdserve-tiny" if model in (None, "", "tiny") else str(model)
        spawned = frontend_address is None
        self.engine_config, afd, self.graph_config = resolve_engine(
            model, kwargs, spawned, usage_context
        )
        model, tokenizer = self.engine_config.model, self.engine_config.tokenizer
        self.generation_config = generation_config
        self._generation_defaults = generation_defaults(generation_config, model)
        if self._generation_defaults:
            log.info(
                "default sampling parameters from the generation config: %s",
                self._generation_defaults,
            )
        device = self.engine_config.device
        speculative = self.engine_config.speculative_config
        mtp = speculative is not None and speculative.is_mtp
        self.afd_config = afd.resolve_connector(device, _cuda_devices(device), spawned, mtp)
        check_mtp_connector(speculative, self.afd_config.connector)
        self.topology = self.afd_config.parsed_topology
        # A quantization_config afdserve cannot honour: one line here, before any rank starts.
        check_quantization(model, self.engine_config.quantization)
        # So is a config field or checkpoint tensor the model cannot run with.
        model_config = preflight(
            model, self.engine_config.load_format, self.engine_config.quantization
        )
        if kwargs.get("graph_mode", "auto") == "auto":
            # What auto becomes where the model's cache layout keeps it eager (model/cache.py).
            max_len = max_model_len_for(self.engine_config, model_config)
            mode, why = auto_graph_mode(model_config, self.graph_config.mode, max_len)
            if why is not None:
                log.info("graph_mode auto is none for %s (%s)", model_config.family, why)
                self.graph_config = dataclasses.replace(self.graph_config, mode=mode)
        check_capturable(model_config, device, self.graph_config.mode)
        # Every rank gets the block size resolved here, as it gets the batch limits.
        self.engine_config = with_block_size(self.engine_config, model_config)
        if self.engine_config.enable_prefix_caching:  # one the model cannot honour: refused here
            prefix_caching_for(self.engine_config, model_config)
        if self.afd_config.ffn_expert_parallel:
            # Checked against the model's experts here, before any rank process starts.
            self.expert_placement = resolve_placement(
                self.afd_config.expert_placement,
                load_model_config(model).num_experts,
                self.topology.ffn_ranks,
            )
        self._step_log = StepLogFile(self.afd_config.log_step_plan)
        self._log_path = self._step_log.path
        self._frontend_address = _parse_address(frontend_address)
        self._usage_context = usage_context
        self._ids = itertools.count()
        self.tokenizer = load_tokenizer(tokenizer or model, self.engine_config.trust_remote_code)
        self.engine: EngineClient = self._start()

    def _start(self) -> EngineClient:
        return EngineClient(self._start_core(), self.tokenizer)

    def _start_core(self) -> EngineCoreClient:
        spec = WorkerSpec(self.engine_config, self.afd_config, self.graph_config, self._log_path)
        device = self.engine_config.device
        # A colocated engine of its own process is a world of one rank that this process spawns.
        own = self._frontend_address is None and self.afd_config.own_engine_process(
            device, self._usage_context
        )
        if self.afd_config.in_process(device) or (self.topology.colocated and not own):
            if self.topology.attention_ranks == 1:
                client: EngineCoreClient = SingleProcessClient(spec)
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
        # Each rank's ready message: its parameter bytes, and for an attention rank the KV cache
        # its engine really allocated (limits.num_blocks of limits.block_size tokens).
        self.rank_ready = dict(sorted(ready.items()))
        self.memory_reports = [ready[r].memory for r in sorted(ready)]
        self.rank_tensor_names = {r: list(ready[r].tensor_names) for r in ready}
        self.prefix_caching = any(info.prefix_caching for info in ready.values())

    # ----- generation -----
    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams (vLLM's rule): the
        generation config's temperature, top_p, top_k, min_p, repetition_penalty and
        max_new_tokens (as max_tokens) where it sets them, SamplingParams' defaults elsewhere."""
        return SamplingParams(**self._generation_defaults)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids as `generate` runs them: text without the tokenizer's special
        tokens (chat templates write their own), token ids as they are."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def encode(self, *args: object, **kwargs: object) -> None:
        """vLLM's LLM.encode runs a pooling model (embeddings), which afdserve does not serve;
        this LLM's tokenizing helper was called encode before, and is encode_prompt now."""
        raise NotImplementedError(
            "LLM.encode: vLLM's pooling API (embeddings) is not served by afdserve; to tokenize "
            "a prompt use LLM.encode_prompt(prompt) or LLM.get_tokenizer().encode(text)"
        )

    def get_tokenizer(self):
        """The tokenizer prompts and outputs go through (vLLM's get_tokenizer)."""
        return self.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in prompt order, each with `n` CompletionOutputs
        (`out.outputs[i]`). A prompt is a string, a list of token ids, or a dict with "prompt" or
        "prompt_token_ids". Every prompt is checked before any runs."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = [_with_tokenizer_dir(self, p) for p in _params_list(sampling_params, len(prompts))]
        encoded = [_truncated(self, _prompt_tokens(self, p), sp) for p, sp in zip(prompts, params)]
        for p in params:
            p.check_vocab(self.engine.vocab_size)
        groups = [[f"gen-{next(self._ids)}" for _ in range(p.candidates)] for p in params]
        added: list[str] = []
        try:
            for ids, tokens, p in zip(groups, encoded, params):
                for request_id, one in zip(ids, candidate_params(p)):
                    self.engine.add_request(request_id, tokens, one)
                    added.append(request_id)
        except Exception:
            for request_id in added:
                self.engine.abort(request_id)
            raise
        done = _run(self, added, groups, use_tqdm)
        return [
            gather(ids[0], _prompt_text(p), [done[i] for i in ids], sp.n, sp.logprobs is not None)
            for ids, p, sp in zip(groups, prompts, params)
        ]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Replies to one conversation (a list of {"role", "content"} dicts) or to several,
        rendered through the tokenizer's chat template (or `chat_template`), with vLLM's
        switches: `add_generation_prompt`, `continue_final_message` (the last, assistant
        message is continued, not closed) and `chat_template_kwargs` (the template's own
        variables, such as an enable_thinking switch)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message: cannot be combined with "
                "add_generation_prompt=True; set that to False"
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        switches = {
            **(chat_template_kwargs or {}),
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        prompts: list[PromptInput] = [
            {"prompt": _render_chat(self, c, chat_template, switches)} for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def step_log(self) -> list[dict]:
        """Every rank's step-plan records (needs log_step_plan)."""
        return self._step_log.read()

    def shutdown(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        if hasattr(self, "_step_log"):
            self._step_log.close()  # every rank has stopped writing

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


# ----- offline API helpers (vLLM's shape: chat, dict prompts, progress) -----


def _render_chat(
    llm: LLM, conversation: list[dict], chat_template: str | None, switches: dict
) -> str:
    return llm.tokenizer.apply_chat_template(
        conversation, chat_template=chat_template, tokenize=False, **switches
    )


def _prompt_text(prompt: PromptInput) -> str | None:
    if isinstance(prompt, str):
        return prompt
    return prompt.get("prompt") if isinstance(prompt, dict) else None


def _prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _params_list(
    sampling_params: SamplingParams | Sequence[SamplingParams], count: int
) -> list[SamplingParams]:
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(
            f"sampling_params: {len(params)} given for {count} prompts (one, or one each)"
        )
    return params


def _prompt_tokens(llm: LLM, prompt: PromptInput) -> list[int]:
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown or len(prompt) != 1:
            raise ValueError(
                f"prompt: a dict prompt has exactly one of 'prompt' or 'prompt_token_ids', "
                f"got keys {sorted(prompt)}"
            )
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        prompt = prompt["prompt"]
    return llm.encode_prompt(prompt)


def _truncated(llm: LLM, tokens: list[int], params: SamplingParams) -> list[int]:
    """truncate_prompt_tokens: the prompt's last N tokens (-1: max_model_len of them)."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return tokens
    limit = llm.engine.max_model_len
    if keep > limit:
        raise ValueError(
            f"SamplingParams.truncate_prompt_tokens={keep}: must be -1 or at most "
            f"max_model_len={limit}"
        )
    return tokens[-(limit if keep == -1 else keep) :]


def _run(
    llm: LLM, request_ids: list[str], groups: list[list[str]], use_tqdm: bool
) -> dict[str, SequenceOutput]:
    """Step until every request finished; with `use_tqdm`, a progress bar over prompts."""
    from tqdm.auto import tqdm

    group_of = {rid: g for g, ids in enumerate(groups) for rid in ids}
    open_in_group = [len(ids) for ids in groups]
    done: dict[str, SequenceOutput] = {}
    with tqdm(
        total=len(groups),
        desc="Processed prompts",
        unit="prompt",
        disable=not use_tqdm,
        dynamic_ncols=True,
    ) as bar:
        while len(done) < len(request_ids):
            for out in llm.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    group = group_of[out.request_id]
                    open_in_group[group] -= 1
                    if open_in_group[group] == 0:
                        bar.update(1)
    return done


def _with_tokenizer_dir(llm: LLM, params: SamplingParams) -> SamplingParams:
    """Structured output: the ranks find the tokenizer in the model directory; the grammar is
    compiled here first, so that a bad one fails before anything runs."""
    structured = params.structured_outputs
    if structured is None:
        return params
    config = llm.engine_config
    structured = dataclasses.replace(structured, tokenizer_dir=config.tokenizer or config.model)
    structured.check()
    return dataclasses.replace(params, structured_outputs=structured)
