"""EmbeddedEngine: an in-process generation engine (CPU by default) behind the RolloutEngine protocol.

It is the rollout path of the embedded deployment and of the synchronous loop. The sampling core,
``EmbeddedEngine.generate_sync``, is a plain synchronous method with no trainer or HTTP imports, so the built-in
SGLang-compatible HTTP server can put the same core behind ``/generate``.

How it samples (one chunk of at most ``max_batch_size`` sequences at a time):
- The prompts are left-padded into one batch with an ``attention_mask`` and explicit
  ``position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)``, so every sequence sees the same positions it
  would see alone (and the same ones the trainer's forward uses).
- One forward over the *distinct* prompts of the chunk fills a KV cache (``DynamicCache``), whose rows are then
  repeated for the n samples of each prompt (an 8x smaller prefill at n = 8). Each later step feeds only the
  sampled token, extending the mask and the positions by one; the prompt is never recomputed. Finished rows
  leave the batch and the cache (once they are a quarter of it), so later steps pay mostly for live rows.
- ``temperature > 0``: sample from ``softmax(logits / T)``, truncated to the top-p nucleus when ``top_p < 1``
  (SGLang's rule: drop a token when the mass before it already exceeds ``top_p``). ``temperature == 0``: greedy.
  A ``torch.Generator`` seeded from ``SamplingParams.seed`` makes a call reproducible (for the same prompts,
  parameters and ``max_batch_size``: the chunks draw from it in turn); without a seed each call draws a fresh
  random seed. The global torch RNG, which training owns, is never touched.

Behaviour logprobs: each output token gets ``log_softmax(logits / T)[token]`` in float32 (T = 1 for greedy),
i.e. the log-probability under the temperature-scaled distribution *before* top-p truncation. That is what SGLang
returns by default, so the trainer sees the same quantity from either engine. With ``top_p = 1`` it is exactly
the distribution the token was sampled from; with ``top_p < 1`` it is not (the truncated distribution puts
more mass on each kept token), and the ESS objective treats the gap like any other engine/trainer mismatch.

Stopping: a sequence finishes when it samples the EOS id or any of ``stop_token_ids`` (the stop token is kept
in ``output_ids`` with its logprob; ``finish_reason="stop"``), or after ``max_new_tokens`` tokens, or when
prompt + output would exceed the model's ``max_position_embeddings`` (both ``"length"``). Lengths come from the
stop position, never from comparing with the pad id: a fresh model can sample the pad token mid-sequence and
that is an ordinary token. The batch ends early once every sequence has finished.

Streaming and early stops: ``generate_sync(..., on_step=callback)`` calls
``callback(seqs, tokens, logprobs, finished)`` after every decoding step, in the generating thread, with the
sequences still live at that step (their indices in the prompt-major output list), the token each one sampled,
its behaviour logprob and, for a sequence that this token ended, its finish reason (``"stop"``/``"length"``,
else ``None``). The callback returns the sequences to end now (they finish with ``"stop"``, keeping the token
just sampled), or ``None``. The HTTP server uses it to stream tokens as they are sampled, to end a sequence at a
stop *string*, and to drop the sequences of a client that went away. Without a callback none of this runs.

Scoring: ``score_sync(ids)`` (``score`` from the event loop) gives the log-probability of each token of ``ids``
after the first, ``log_softmax(logits)[token]`` in float32 at T = 1, from one forward over the whole sequence:
SGLang's ``input_token_logprobs``. The weight-publication check (app/rollout/probe.py) compares them with the
trainer's on a fixed text after every published version.

Concurrency: one lock serialises generation and weight updates (as SGLang's reader/writer lock does for one
request stream): an update waits for the running generate call, and a generate never sees half-loaded weights.
The async methods run the work in a worker thread so the event loop stays free.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from transformers import DynamicCache

from app.rollout.base import Completion, ProbeReading, SamplingParams, WeightSource

StepCallback = Callable[[list[int], list[int], list[float], list["str | None"]], "Iterable[int] | None"]
"""``on_step(seqs, tokens, logprobs, finished) -> sequences to end now``; see "Streaming and early stops"."""


def _contiguous_input(module: torch.nn.Module, args: tuple) -> tuple:
    """Forward pre-hook of the output head: its input as a contiguous tensor (see EmbeddedEngine._setup)."""
    return (args[0].contiguous(), *args[1:])


class EmbeddedEngine:
    """An in-process RolloutEngine that owns a private copy of a Hugging Face causal LM.

    Args:
        model: a transformers causal LM (e.g. ``Qwen2ForCausalLM``). It is deep-copied, so later changes to
            ``model`` (training) never reach the engine except through ``update_weights``.
        eos_token_id: always a stop token.
        pad_token_id: fills the left padding; its value never affects outputs.
        max_batch_size: sequences per forward batch; larger calls are split into chunks.
        policy_version: version reported in ``Completion.policy_version`` until the next ``update_weights``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_id: int,
        pad_token_id: int,
        max_batch_size: int = 256,
        policy_version: int = 0,
    ) -> None:
        self._setup(copy.deepcopy(model), eos_token_id, pad_token_id, max_batch_size, policy_version)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        max_batch_size: int = 256,
        policy_version: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> EmbeddedEngine:
        """Load an HF directory (AutoModelForCausalLM + AutoTokenizer for the EOS and pad ids)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
        if isinstance(eos, (list, tuple)):
            eos = eos[0]
        if eos is None:
            raise ValueError(
                f"{path}: neither the tokenizer nor config.json defines an EOS token; set eos_token in "
                "tokenizer_config.json or eos_token_id in config.json"
            )
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        engine = cls.__new__(cls)
        engine._setup(model, int(eos), int(pad), max_batch_size, policy_version)  # already private: no copy
        return engine

    def _setup(
        self, model: torch.nn.Module, eos_token_id: int, pad_token_id: int, max_batch_size: int, version: int
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        self.max_batch_size = int(max_batch_size)
        self.policy_version = int(version)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions: int | None = getattr(model.config, "max_position_embeddings", None)
        self._device = next(model.parameters()).device
        # The forward's `logits_to_keep=1` hands the output head a strided view (the last position of [B, T, H]).
        # torch's CPU bf16 linear does not fold such a view into one matrix product: it expands the head's weight
        # per row ([B, H, V], 13.6 GB for 240 prompts of SmolLM2) and runs 160x slower than on a contiguous
        # copy of the same [B, 1, H] (tests/unit/test_embedded_engine.py). The copy costs B x H values.
        model.get_output_embeddings().register_forward_pre_hook(_contiguous_input)
        # transformers 5.24 renamed the forward's `past_key_values` to `cache` (old name deprecated).
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._lock = threading.Lock()

    # ---- RolloutEngine protocol -------------------------------------------------------------------------

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, progress: Callable[[int], None] | None = None
    ) -> list[Completion]:
        return await asyncio.to_thread(self.generate_sync, prompts, params, progress=progress)

    async def update_weights(self, source: WeightSource, version: int) -> None:
        await asyncio.to_thread(self.update_weights_sync, source, version)

    async def health(self) -> bool:
        return True

    async def score(self, ids: list[int]) -> list[ProbeReading]:
        """``score_sync`` in a worker thread, as the one reading of this engine."""
        logprobs, version = await asyncio.to_thread(self.score_sync, ids)
        return [ProbeReading("the embedded engine", str(version), logprobs)]

    # ---- synchronous core -------------------------------------------------------------------------------

    def generate_sync(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        on_step: StepCallback | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        """Sample ``params.n`` completions per prompt; results are prompt-major (p0s0, p0s1, ..., p1s0, ...).

        ``on_step`` (optional) sees every sampled token as it is sampled and may end sequences early (see the
        module docstring); the sampling itself, and so the result for the same seed, does not depend on it
        except for the sequences it ends. ``progress(k)`` (optional) is told each time k more sequences finish.
        """
        prompts = [self._check_prompt(i, p) for i, p in enumerate(prompts)]
        sequences = [i for i in range(len(prompts)) for _ in range(params.n)]  # prompt-major
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        generator = torch.Generator(device=self._device)
        generator.manual_seed(seed)
        stop_ids = torch.tensor(
            sorted({self.eos_token_id, *params.stop_token_ids}), dtype=torch.long, device=self._device
        )
        completions: list[Completion] = []
        with self._lock, torch.inference_mode():
            version = self.policy_version
            for start in range(0, len(sequences), self.max_batch_size):
                chunk = sequences[start : start + self.max_batch_size]
                # Equal prompts (the n samples of one prompt, or repeats in the list) share one prefill.
                distinct: dict[tuple[int, ...], int] = {}
                expand = [distinct.setdefault(tuple(prompts[p]), len(distinct)) for p in chunk]
                chunk_prompts = [list(key) for key in distinct]
                completions.extend(
                    self._generate_chunk(
                        chunk_prompts, expand, params, stop_ids, generator, version, start, on_step, progress
                    )
                )
        return completions

    def update_weights_sync(self, source: WeightSource, version: int, *, complete: bool = True) -> None:
        """Load new weights into the existing model and set the policy version.

        Strict: every parameter must get a value of its shape and no unknown key may appear; the one thing
        allowed to be absent is the second name of a tied parameter (``lm_head.weight`` tied to the
        embeddings, which ``save_pretrained`` leaves out). ``complete=False`` loads part of the model (one
        bucket of a distributed update): then only unknown keys and wrong shapes are refused. Everything is
        checked before anything is copied, so a rejected update leaves the old weights and version in place.
        """
        with self._lock, torch.no_grad():
            if source.state_dict is not None:
                state, origin = source.state_dict, "state_dict"
            else:
                state, origin = self._read_directory(Path(source.path)), str(source.path)
            self._check_state_dict(state, origin, complete=complete)
            self.model.load_state_dict(state, strict=False)
            self.policy_version = int(version)

    def score_sync(self, ids: list[int]) -> tuple[list[float], int]:
        """(log pi(ids[t] | ids[:t]) for t = 1 .. len(ids) - 1 in float32 at temperature 1, the policy version that
        computed them); ``ids`` needs at least two tokens. The same weights give both: the lock holds updates
        back."""
        ids = self._check_prompt(0, ids)
        if len(ids) < 2:
            raise ValueError("scoring needs at least two tokens (the first one has no log-probability)")
        with self._lock, torch.inference_mode():
            tokens = torch.tensor([ids], device=self._device)
            logits = self.model(
                input_ids=tokens,
                attention_mask=torch.ones_like(tokens),
                position_ids=torch.arange(len(ids), device=self._device)[None],
                use_cache=False,
            ).logits[0, :-1].float()
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[0, 1:, None]).squeeze(-1)
            return logprobs.tolist(), self.policy_version

    # ---- internals ----------------------------------------------------------------------------------------

    def _check_prompt(self, index: int, prompt: list[int]) -> list[int]:
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError(f"prompts[{index}] is empty; every prompt needs at least one token (e.g. BOS)")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompts[{index}] has token ids outside [0, {self.vocab_size}): {bad[:5]}")
        if self.max_positions is not None and len(prompt) >= self.max_positions:
            raise ValueError(
                f"prompts[{index}] has {len(prompt)} tokens, leaving no room under the model's "
                f"max_position_embeddings={self.max_positions}; shorten the prompt"
            )
        return prompt

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        return out.logits[:, -1, :].float()

    def _generate_chunk(
        self,
        prompts: list[list[int]],
        expand: list[int],
        params: SamplingParams,
        stop_ids: torch.Tensor,
        generator: torch.Generator,
        version: int,
        offset: int = 0,
        on_step: StepCallback | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        """Sample one sequence per entry of ``expand`` (an index into the distinct ``prompts``).

        Row ``r`` of the chunk is sequence ``offset + r`` of the whole call (what ``on_step`` is told).

        Each distinct prompt is run through the model once and its KV cache rows are repeated for its n
        samples. Finished rows are dropped from the batch (cache, mask, positions) once they are a quarter
        of it, so that the remaining steps pay mostly for live sequences.
        """
        device, unique = self._device, len(prompts)
        prompt_lens = torch.tensor([len(p) for p in prompts], device=device)
        width = int(prompt_lens.max())
        input_ids = torch.full((unique, width), self.pad_token_id, dtype=torch.long, device=device)
        attention_mask = torch.zeros((unique, width), dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)

        cache = DynamicCache(config=self.model.config)
        logits = self._forward(input_ids, attention_mask, position_ids, cache)
        if expand != list(range(unique)):
            index = torch.tensor(expand, dtype=torch.long, device=device)
            logits, attention_mask, prompt_lens = logits[index], attention_mask[index], prompt_lens[index]
            cache.batch_select_indices(index)

        batch = len(expand)
        # Per-sequence budget: max_new_tokens, and prompt + output within max_position_embeddings.
        limits = torch.full((batch,), params.max_new_tokens, device=device)
        if self.max_positions is not None:
            limits = torch.minimum(limits, self.max_positions - prompt_lens)
        steps = int(limits.max())
        tokens = torch.zeros((batch, steps), dtype=torch.long, device=device)
        logprobs = torch.zeros((batch, steps), dtype=torch.float32, device=device)
        lengths = torch.full((batch,), steps, dtype=torch.long, device=device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=device)

        rows = torch.arange(batch, device=device)  # original row of each batch row
        alive = torch.ones(batch, dtype=torch.bool, device=device)
        next_pos = prompt_lens.clone()
        for step in range(steps):
            token, logprob = self._sample(logits, params, generator)
            live_rows = rows[alive]
            tokens[live_rows, step] = token[alive]
            logprobs[live_rows, step] = logprob[alive]
            is_stop = torch.isin(token, stop_ids)
            finished = alive & (is_stop | (limits[rows] <= step + 1))
            if on_step is not None:
                halted = self._report_step(
                    on_step, offset, live_rows, token[alive], logprob[alive], finished[alive], is_stop[alive]
                )
                if halted:
                    halt = alive & ~finished & torch.isin(rows, torch.tensor(halted, device=device))
                    is_stop, finished = is_stop | halt, finished | halt
            lengths[rows[finished]] = step + 1
            stopped[rows[finished & is_stop]] = True
            if progress is not None and (done := int(finished.sum())):
                progress(done)
            alive &= ~finished
            live = int(alive.sum())
            if live == 0 or step + 1 == steps:
                break
            # Rows that finished keep computing (their tokens are never written) until they are a quarter of
            # the batch: copying the KV cache at every single finish would cost more than it saves.
            if live <= 0.75 * len(rows):
                keep = alive.nonzero().squeeze(1)
                rows, alive, token, next_pos = rows[keep], alive[keep], token[keep], next_pos[keep]
                attention_mask = attention_mask[keep]
                cache.batch_select_indices(keep)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(rows), 1))], dim=1)
            logits = self._forward(token[:, None], attention_mask, next_pos[:, None], cache)
            next_pos += 1
            if self.max_positions is not None:
                next_pos.clamp_(max=self.max_positions - 1)  # only finished rows get there; keep them valid

        tokens_list, logprobs_list = tokens.tolist(), logprobs.tolist()
        lengths_list, stopped_list = lengths.tolist(), stopped.tolist()
        completions = []
        for row, which in enumerate(expand):
            n = lengths_list[row]
            completions.append(
                Completion(
                    prompt_ids=list(prompts[which]),
                    output_ids=tokens_list[row][:n],
                    output_logprobs=logprobs_list[row][:n],
                    finish_reason="stop" if stopped_list[row] else "length",
                    policy_version=version,
                    meta={"prompt_tokens": len(prompts[which]), "completion_tokens": n},
                )
            )
        return completions

    @staticmethod
    def _report_step(
        on_step: StepCallback,
        offset: int,
        live_rows: torch.Tensor,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        finished: torch.Tensor,
        is_stop: torch.Tensor,
    ) -> list[int]:
        """Tell ``on_step`` this step's tokens of the live rows; the chunk rows it asks to end."""
        reasons = [
            ("stop" if stop else "length") if done else None
            for done, stop in zip(finished.tolist(), is_stop.tolist(), strict=True)
        ]
        seqs = [offset + row for row in live_rows.tolist()]
        halted = on_step(seqs, tokens.tolist(), logprobs.tolist(), reasons)
        return [seq - offset for seq in halted or ()]  # a sequence of another chunk matches no row

    @staticmethod
    def _sample(
        logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token [B] and its behaviour logprob [B] from the last-position logits [B, V] (float32)."""
        if params.temperature == 0:
            logp = torch.log_softmax(logits, dim=-1)
            token = logits.argmax(dim=-1)
        else:
            logp = torch.log_softmax(logits / params.temperature, dim=-1)
            probs = logp.exp()
            if params.top_p < 1:
                sorted_probs, order = probs.sort(dim=-1, descending=True)
                outside = (sorted_probs.cumsum(dim=-1) - sorted_probs) > params.top_p
                sorted_probs = sorted_probs.masked_fill(outside, 0.0)
                choice = torch.multinomial(sorted_probs, 1, generator=generator)
                token = order.gather(-1, choice).squeeze(-1)
            else:
                token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)

    def _read_directory(self, path: Path) -> dict[str, torch.Tensor]:
        """Every ``*.safetensors`` file of an HF directory (one file or shards), merged into one state dict."""
        from safetensors.torch import load_file

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path}: no *.safetensors files; save the model with save_pretrained(path)")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file), device=str(self._device)))
        return state

    def _check_state_dict(self, state: dict[str, torch.Tensor], origin: str, *, complete: bool = True) -> None:
        expected = self.model.state_dict()
        named = dict(self.model.named_parameters(remove_duplicate=False))
        loaded = {id(named[k]) for k in state if k in named}
        missing = [
            k for k in expected if complete and k not in state and not (k in named and id(named[k]) in loaded)
        ]
        unexpected = [k for k in state if k not in expected]
        wrong_shape = [
            f"{k}: {tuple(state[k].shape)} != {tuple(expected[k].shape)}"
            for k in state
            if k in expected and state[k].shape != expected[k].shape
        ]
        if missing or unexpected or wrong_shape:
            raise ValueError(
                f"weights from {origin} do not fit the engine's model (missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}, wrong shapes {wrong_shape[:5]}); they must come from the same architecture"
            )
