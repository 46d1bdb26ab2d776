"""The engine: a thin step loop over the scheduler, block manager and model runner.

Two modes make disaggregation: ``prefill_only`` returns the first token plus the prompt's
full KV blocks (hashes and tensors); a request carrying such a :class:`KVHandoff` loads them
into its pool and continues decoding. Run in two processes, that is prefill/decode split.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from cleave.kv_store.block_hash import KVFingerprint, chain_hashes, salted_root
from cleave.kv_store.codec import header_size
from cleave.runtime.engine.block_manager import BlockManager
from cleave.runtime.engine.config import EngineConfig, GiB
from cleave.runtime.engine.dense.decoder import PagedDecoder
from cleave.runtime.engine.dense.graphs import DecodeGraphs
from cleave.runtime.engine.detokenizer import IncrementalDetokenizer
from cleave.runtime.engine.grammar import Grammars
from cleave.runtime.engine.kv_pool import KVPool, default_budget
from cleave.runtime.engine.model_runner import ModelRunner
from cleave.runtime.engine.models import build_model, check_parallel
from cleave.runtime.engine.outputs import Completion, KVHandoff, RequestOutput, RequestTimes
from cleave.runtime.engine.paged_model import PagedModel
from cleave.runtime.engine.parallel import leader as parallel
from cleave.runtime.engine.parallel.follower import rank_device
from cleave.runtime.engine.parallel.leader import Followers
from cleave.runtime.engine.parallel.shard import Shard
from cleave.runtime.engine.scheduler import Scheduler, SchedulerConfig
from cleave.runtime.engine.sequence import (
    FinishReason,
    RequestError,
    SamplingParams,
    Sequence,
    TokenLogprob,
)
from cleave.runtime.engine.shape import ModelShape
from cleave.runtime.models.device import resolve_device, resolve_dtype
from cleave.runtime.models.loader import (
    ModelFiles,
    Progress,
    load_config,
    load_state_dict,
    load_tokenizer,
    log_to_stderr,
    resolve_model,
)


@dataclass
class EngineStats:
    prompt_tokens_computed: int = 0  # prefill work actually done (cache hits excluded)
    generated_tokens: int = 0
    steps: int = 0
    preemptions: int = 0


@dataclass
class _Clock:
    """A request's events in this engine, on the monotonic clock (vLLM's QUEUED, first
    SCHEDULED, first and last NEW_TOKENS)."""

    queued: float
    scheduled: float | None = None
    first_token: float | None = None

    def times(self, now: float) -> RequestTimes:
        scheduled = self.scheduled if self.scheduled is not None else now
        first = self.first_token if self.first_token is not None else now
        return RequestTimes(queue=scheduled - self.queued, prefill=first - scheduled,
                            decode=now - first, inference=now - scheduled)


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: Progress = log_to_stderr) -> None:
        torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        progress(f"loading model '{config.model}' ({self.dtype}, {self.device})")
        files = resolve_model(config.model, config.cache_dir, progress, config.revision)
        self.model_files = files
        hf_config, shape = load_config(files)
        self.shape: ModelShape = shape
        self.hf_config = hf_config
        self.tokenizer = load_tokenizer(files)
        self.max_model_len = min(config.max_model_len or shape.max_position_embeddings,
                                 shape.max_position_embeddings)
        self._followers: Followers | None = None
        if config.tensor_parallel_size == 1:
            self.model: PagedModel = build_model(hf_config, load_state_dict(files), self.dtype,
                                                 self.device)
            self.pool = KVPool.from_budget(self.model.kv_layout, self._kv_budget(),
                                           config.block_size, self.dtype, self.device)
        else:
            self.model, self.pool = self._load_parallel(files, hf_config)
        layout = self.model.kv_layout
        self.fingerprint = KVFingerprint(
            model_name=files.name, weights_digest=files.weights_digest,
            dtype=str(self.dtype).removeprefix("torch."), num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
            block_size=config.block_size, salt=config.salt)
        self.root_hash = self.fingerprint.root_hash()
        self.graphs = self._decode_graphs()
        # With graphs the pool's last block is their padded rows' scratch space.
        usable = self.pool.num_blocks - (self.graphs is not None)
        self.block_manager = BlockManager(usable, config.block_size, self.root_hash)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len), self.block_manager)
        self.runner = ModelRunner(self.model, self.pool, self.graphs)
        self.block_shape = layout.block_shape(config.block_size)
        # Exported blocks leave room for the store's header in front of each (zero-copy puts).
        self.export_header_room = header_size(len(self.block_shape))
        self.eos_token_ids = self._eos_ids()
        self.grammars = Grammars(self.tokenizer, self.shape.vocab_size, self.eos_token_ids)
        self.stats = EngineStats()
        # Called on the engine thread with each step's token count (the worker's histogram).
        self.step_observer: Callable[[int], None] | None = None
        self._clocks: dict[str, _Clock] = {}
        self._sequences: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._handoffs: dict[str, KVHandoff] = {}
        progress(f"model ready: {shape.num_layers} layers, KV pool {self.pool.num_blocks} blocks "
                 f"x {config.block_size} tokens ({self.pool.nbytes / GiB:.2f} GiB)")

    def _kv_budget(self) -> int:
        return default_budget(self.config.kv_cache_bytes, self.device)

    def _load_parallel(self, files: ModelFiles, hf_config: Any) -> tuple[PagedModel, KVPool]:
        """Rank 0 of ``tensor_parallel_size``: followers load their shards while this one
        does; the returned model and pool drive every rank (``engine/parallel``)."""
        size = self.config.tensor_parallel_size
        check_parallel(hf_config, size)  # refuse before any process starts
        self.device = rank_device(self.device, 0)
        self._followers = followers = parallel.start(self.config, files, self.dtype, self.device)
        try:
            model = build_model(hf_config, load_state_dict(files), self.dtype, self.device,
                                Shard(0, size))
            return parallel.join(followers, model, self._kv_budget(), self.config.block_size,
                                 self.dtype, self.device)
        except BaseException:
            self.close()
            raise

    def _decode_graphs(self) -> DecodeGraphs | None:
        mode, bs = self.config.decode_graphs, self.config.block_size
        if mode == "off" or (mode == "auto" and self.device.type != "cuda"):
            return None
        model = self.model
        if not isinstance(model, PagedDecoder) or model.spec.moe is not None \
                or model.shard is not None or self.pool.num_blocks < 2:
            return None  # experts read counts on the host; ranks step through pipes
        return DecodeGraphs(model, self.pool.k, self.pool.v, bs, self.pool.num_blocks - 1,
                            -(-self.max_model_len // bs), capture=self.device.type == "cuda")

    def close(self) -> None:
        """Stop the tensor-parallel follower ranks, if any (they also exit with this process)."""
        if self._followers is not None:
            self._followers.close()
            self._followers = None

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.hf_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list):
                ids.update(source)
        return frozenset(ids)

    # -- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return list(prompt)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template; use a plain completion")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        return self.tokenize(str(text))

    def make_sequence(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                      *, prefill_only: bool = False, kv: KVHandoff | None = None) -> Sequence:
        """Validate a request and build its state; touches no shared engine state."""
        ids = self.tokenize(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        if any(not 0 <= t < self.shape.vocab_size for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {self.shape.vocab_size})")
        if params.max_token_id() >= self.shape.vocab_size:
            raise RequestError(f"logit_bias and stop_token_ids name token ids in "
                               f"[0, {self.shape.vocab_size})")
        total = len(ids) + params.max_tokens
        if len(ids) >= self.max_model_len or total > self.max_model_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: "
                f"{total} exceeds this model's maximum context of {self.max_model_len} tokens")
        if self.block_manager.blocks_for(total) > self.block_manager.num_blocks:
            raise RequestError(f"{total} tokens do not fit in the KV pool "
                               f"({self.block_manager.num_blocks} blocks); raise kv_cache_bytes")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        seq = Sequence(request_id, ids, len(ids), params, eos_token_ids=self.eos_token_ids,
                       prefill_only=prefill_only, sampling_seed=seed)
        if params.grammar is not None:
            seq.constraint = self.grammars.constraint(params.grammar)
        if params.prompt_logprobs is not None and (kv is None or kv.first_token is None):
            seq.prompt_logprobs = []  # a request handed its first token was scored upstream
        if kv is not None:
            if kv.first_token is not None:
                out = kv.output_tokens
                if any(not 0 <= t < self.shape.vocab_size for t in out):
                    raise RequestError(f"output token ids must be in [0, {self.shape.vocab_size})")
                seq.token_ids.extend(out)
                if kv.first_logprob is not None and not kv.earlier_tokens:
                    seq.logprobs.append(kv.first_logprob)
            if not seq.scores_prompt:  # a cached prefix has no logits to score
                seq.num_external_blocks = self._verified_blocks(ids, kv, params.cache_salt)
        return seq

    def _verified_blocks(self, prompt: list[int], kv: KVHandoff,
                         cache_salt: str | None = None) -> int:
        """How many leading handed-over blocks really are this prompt under this fingerprint.

        Anything past the first mismatch is a miss and is recomputed, never trusted.
        """
        expected = chain_hashes(salted_root(self.root_hash, cache_salt), prompt,
                                self.config.block_size)
        n = 0
        for got, want in zip(kv.block_hashes, expected, strict=False):
            if got != want:
                break
            n += 1
        for block in kv.blocks[:n]:
            if tuple(block.shape) != self.block_shape or block.dtype != self.dtype:
                return 0
        return min(n, len(kv.blocks))

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    *, prefill_only: bool = False, kv: KVHandoff | None = None) -> Sequence:
        seq = self.make_sequence(request_id, prompt, params, prefill_only=prefill_only, kv=kv)
        self.enqueue(seq, kv)
        return seq

    def enqueue(self, seq: Sequence, kv: KVHandoff | None = None) -> list[RequestOutput]:
        """Hand a validated sequence to the scheduler; may finish it at once (see below)."""
        if seq.request_id in self._sequences:
            raise RequestError(f"request id '{seq.request_id}' is already in use")
        self._sequences[seq.request_id] = seq
        self._clocks[seq.request_id] = _Clock(time.monotonic())
        self._detok[seq.request_id] = IncrementalDetokenizer(self.tokenizer, seq.params.stop)
        if kv is not None and kv.first_token is not None:
            # The caller has these tokens' text, exactly as far as a detokenizer fed them one by
            # one would have handed it out (held-back bytes and stop-string prefixes included).
            self._detok[seq.request_id].replay(kv.output_tokens)
            reason = seq.stop_reason_after(kv.first_token, self.max_model_len)
            if reason is not None or self._detok[seq.request_id].stopped:
                # The prefill side's first token already ended the request.
                self.scheduler.finish(seq, reason or FinishReason.STOP)
                return [self._output(seq, [], [])]
        if kv is not None and seq.num_external_blocks:
            self._handoffs[seq.request_id] = kv
        self.scheduler.add(seq)
        return []

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id) is not None:
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        self._sequences.pop(request_id, None)
        self._detok.pop(request_id, None)
        self._handoffs.pop(request_id, None)
        self._clocks.pop(request_id, None)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def kv_usage_ratio(self) -> float:
        return self.block_manager.usage_ratio()

    # -- the step loop -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if not out.chunks:
            return []
        for load in out.loads:
            kv = self._handoffs.pop(load.seq.request_id)
            self.pool.import_blocks(load.seq.block_table[load.first:load.end],
                                    kv.blocks[load.first:load.end])
        self._stamp((c.seq for c in out.chunks), first_token=False)
        self.stats.steps += 1
        self.stats.preemptions += len(out.preempted)
        if self.step_observer is not None:
            self.step_observer(out.num_tokens)
        self.stats.prompt_tokens_computed += sum(
            max(0, min(c.start + c.num_tokens, c.seq.num_prompt_tokens) - c.start)
            for c in out.chunks)
        seqs, tokens, logprobs, scores = self.runner.execute(out)
        for scored, entries in scores:
            assert scored.prompt_logprobs is not None
            scored.prompt_logprobs += entries
        exports = {id(s): self._export(s, t, lp) for s, t, lp in zip(seqs, tokens, logprobs,
                                                                   strict=True) if s.prefill_only}
        self.scheduler.commit(out, {id(s): t for s, t in zip(seqs, tokens, strict=True)})
        self._stamp(seqs, first_token=True)
        self.stats.generated_tokens += len(seqs)
        results = []
        for seq, token, lp in zip(seqs, tokens, logprobs, strict=True):
            if lp is not None:
                seq.logprobs.append(lp)
            # The prompt's logprobs go out once, with the first token (the prompt is done).
            prompt = seq.prompt_logprobs if seq.num_output_tokens == 1 else None
            results.append(self._output(seq, [token], [lp] if lp else [], exports.get(id(seq)),
                                        prompt))
        return results

    def _stamp(self, seqs: Iterable[Sequence], first_token: bool) -> None:
        """Stamp first scheduled (or first token) on these requests' clocks, once each."""
        now = time.monotonic()
        for seq in seqs:
            clock = self._clocks.get(seq.request_id)
            if clock is None:
                continue
            if first_token and clock.first_token is None:
                clock.first_token = now
            elif not first_token and clock.scheduled is None:
                clock.scheduled = now

    def _export(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> KVHandoff:
        n = seq.num_prompt_tokens // self.config.block_size
        buffer, blocks = self.pool.export_blocks(seq.block_table[:n], self.export_header_room)
        return KVHandoff(block_hashes=list(seq.block_hashes[:n]), blocks=blocks,
                         first_token=token, first_logprob=lp, buffer=buffer,
                         header_room=self.export_header_room)

    def _output(self, seq: Sequence, new_ids: list[int], new_lps: list[TokenLogprob],
                handoff: KVHandoff | None = None,
                prompt_logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        detok = self._detok[seq.request_id]
        detok.add(new_ids)
        if detok.stopped and not seq.is_finished:
            self.scheduler.finish(seq, FinishReason.STOP)
        finished = seq.is_finished
        out = RequestOutput(
            request_id=seq.request_id, new_token_ids=new_ids,
            new_text=detok.take_delta(final=finished), finished=finished,
            finish_reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens, num_cached_tokens=seq.num_cached_tokens,
            new_logprobs=new_lps, handoff=handoff, prompt_logprobs=prompt_logprobs)
        if finished:
            clock = self._clocks.get(seq.request_id)
            out.times = clock.times(time.monotonic()) if clock is not None else None
            self._release(seq.request_id)
        return out

    # -- convenience ---------------------------------------------------------------------
    def generate(self, prompts: Iterable[str | list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run prompts to completion (offline use, tests, benchmarks)."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{i}-{random.getrandbits(32):08x}" for i in range(len(prompts))]
        results = {rid: Completion(rid) for rid in ids}
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        while self.has_unfinished:
            for o in self.step():
                results[o.request_id].absorb(o)
        return [results[rid] for rid in ids]
