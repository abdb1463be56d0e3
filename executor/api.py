"""The Python API: ``LLM`` over one materialized plan, shaped like vLLM's.

::

    from executor import LLM, SamplingParams

    llm = LLM("path/to/Qwen3-8B", hardware="h200", max_context=8192)   # a checkpoint directory
    outs = llm.generate(["Hello", "2+2="], SamplingParams(max_new_tokens=16))
    print(outs[0].text, outs[0].output_ids, outs[0].finish_reason)
    print(llm.plan.budget)       # the MemoryPlan it runs on
    print(llm.report.text)       # the last run's report (executor.serving.RunReport)

``LLM(model, ...)`` plans ``model`` (a checkpoint directory, an HF config.json, a YAML file or a shipped
name; or a ``MemoryPlan``, which must equal what the planner builds from its configs) on ``hardware``
with the serving config and overrides (``max_context``, ``max_batch``, any ServingConfig field),
materializes it once on ``device`` and loads the weights: the directory's safetensors, ``checkpoint=DIR``,
or ``random_weights=True``. The tokenizer and generation defaults are the weights' directory's (or
``tokenizer=DIR``'s tokenizer). ``generate`` takes texts or id lists; ``chat`` takes conversations
(rendered with the checkpoint's chat template). Both run the requests as one continuously batched
workload and return one ``RequestOutput`` per request, in input order. A ``SamplingParams`` field left
None takes the checkpoint's default (generation_config.json with do_sample), else greedy.

With ``tensor_parallel_size=N`` the process that builds the ``LLM`` is rank 0 and starts N - 1 rank
processes (executor/workers.py); ``close()`` (or leaving a ``with LLM(...)`` block) stops them, and a
rank that fails raises ``RankError`` naming it.

Errors are the CLI's: ConfigError (configs, plan), WeightsError, TokenizerError, RunError, RankError.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from executor.generation import SamplingParams, read_generation_defaults
from executor.serving import RANDOM_WEIGHTS, RunReport, ServedModel
from executor.workload import RequestSpec, RunError, mark_out_of_vocabulary, request_seed

if TYPE_CHECKING:
    from executor.engine import RequestResult
    from executor.tokenizer import Tokenizer
    from planner.plan import MemoryPlan

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

Prompt = str | Sequence[int]
Conversation = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class RequestOutput:
    """One request's output: its prompt, the generated ids and text, why it finished and when."""

    index: int
    prompt: str | None  # the text prompt (None for ids)
    prompt_ids: list[int]
    output_ids: list[int]
    text: str | None  # None without a tokenizer
    finish_reason: str  # "stop", "length" or "rejected"
    error: str | None = None  # why it was rejected
    ttft_s: float | None = None
    token_latencies_s: tuple[float, ...] = ()

    @property
    def token_ids(self) -> list[int]:
        """vLLM's name for the generated ids."""
        return self.output_ids


class LLM:
    """A model served from one plan; see the module docstring."""

    def __init__(self, model: str | Path | MemoryPlan, *, hardware: str = "h200", serving: str | None = None,
                 max_context: int | None = None, max_batch: int | None = None, device: str = "auto",
                 checkpoint: str | Path | None = None, random_weights: bool = False, seed: int = 0,
                 tokenizer: str | Path | None = None, eager: bool = False, prefix_caching: bool = True,
                 **serving_overrides: Any):
        plan, model_path = _plan(model, hardware, serving, {"max_context": max_context, "max_batch": max_batch,
                                                            **serving_overrides})
        weights = _weights(model_path, checkpoint, random_weights)
        directory = None if weights == RANDOM_WEIGHTS else Path(weights)
        self._served = ServedModel.open(plan, device, weights=weights, seed=seed,
                                        tokenizer=_tokenizer(tokenizer, directory or model_path),
                                        generation=read_generation_defaults(directory, plan.model.vocab_size),
                                        eager=eager)
        self._seed, self._prefix_caching = seed, prefix_caching
        self._requests_made = 0  # requests of earlier calls: an unseeded request's stream is its place in them
        self._report: RunReport | None = None

    @property
    def plan(self) -> MemoryPlan:
        return self._served.plan

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._served.tokenizer

    @property
    def report(self) -> RunReport | None:
        """The last ``generate`` or ``chat`` run's report (None before the first)."""
        return self._report

    def close(self) -> None:
        """With tensor parallelism, stop the other ranks' processes (no more generate or chat after it)."""
        self._served.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for a text, an id list, or a list of them; ``sampling_params``: one for all or one each."""
        batch = [prompts] if isinstance(prompts, str) or _is_ids(prompts) else list(prompts)
        encoded = []
        for prompt in batch:
            if isinstance(prompt, str):
                encoded.append((prompt, self._require_tokenizer("a text prompt").encode(prompt)))
            elif _is_ids(prompt):
                encoded.append((None, [int(t) for t in prompt]))
            else:
                raise TypeError(f"a prompt is a string or a list of ints, got {type(prompt).__name__}")
        return self._run(encoded, sampling_params)

    def chat(self, conversations: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             **chat_template_kwargs: Any) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a list of them,
        each rendered by the checkpoint's chat template with the generation prompt."""
        tokenizer = self._require_tokenizer("chat")
        batch = [conversations] if conversations and isinstance(conversations[0], Mapping) else list(conversations)
        encoded = [(None, tokenizer.encode_chat(list(conversation), **chat_template_kwargs)) for conversation in batch]
        return self._run(encoded, sampling_params)

    def _run(self, encoded: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[RequestOutput]:
        params = _per_request(sampling_params, len(encoded))
        first, self._requests_made = self._requests_made, self._requests_made + len(encoded)
        specs = [self._spec(first + index, ids, p) for index, ((_, ids), p) in enumerate(zip(encoded, params))]
        mark_out_of_vocabulary(specs, self.plan.model.vocab_size)
        outputs: dict[int, RequestOutput] = {}

        def on_output(index: int, spec: RequestSpec, result: RequestResult | None, text: str | None) -> None:
            outputs[index] = _output(index, encoded[index][0], spec, result, text)

        self._report = self._served.run(specs, on_output=on_output, prefix_caching=self._prefix_caching)
        return [outputs[index] for index in range(len(specs))]

    def _spec(self, number: int, ids: list[int], params: SamplingParams) -> RequestSpec:
        """The request ``number`` of this LLM's life (0, 1, ... across calls) as a spec; unseeded, it gets a
        stream of its own (``request_seed``), so equal prompts sample apart, here and across calls."""
        defaults = self._served.generation.sampling
        if params.stop and self.tokenizer is None:
            raise RunError("stop strings need a tokenizer, and this run has none (no checkpoint's tokenizer.json, "
                           "no tokenizer=DIR)")
        pick = lambda value, default: default if value is None else value  # noqa: E731
        return RequestSpec(ids, params.max_new_tokens, list(params.stop_ids),
                           temperature=float(pick(params.temperature, defaults.temperature)),
                           top_k=int(pick(params.top_k, defaults.top_k)),
                           seed=int(pick(params.seed, request_seed(self._seed, number))),
                           top_p=float(pick(params.top_p, defaults.top_p)),
                           stop=list(params.stop), ignore_eos=params.ignore_eos)

    def _require_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise RunError(f"{what} needs a tokenizer, and this run has none (no checkpoint's tokenizer.json, no "
                           "tokenizer=DIR): give tokenizer=DIR, or prompts as id lists")
        return self.tokenizer


def _plan(model: str | Path | MemoryPlan, hardware: str, serving: str | None,
          overrides: dict[str, Any]) -> tuple[MemoryPlan, Path | None]:
    """The plan, and the model's directory when it is one."""
    from planner.errors import ConfigError
    from planner.loader import plan_from_configs
    from planner.plan import MemoryPlan
    from planner.validate import plan_difference

    if isinstance(model, MemoryPlan):
        given = [name for name, value in overrides.items() if value is not None]
        if given or serving is not None:
            raise RunError(f"a MemoryPlan holds its serving config; drop {', '.join(given) or 'serving'}")
        difference = plan_difference(model)
        if difference is not None:
            where, value, expected = difference
            raise ConfigError("plan", where.lstrip("."), value,
                              f"differs from the plan this planner builds from its configs ({expected!r}); re-plan")
        return model, None
    path = Path(model)  # serving None: the hardware's default_serving, as memplan plan and run use
    return plan_from_configs(str(model), hardware, serving, overrides), path if path.is_dir() else None


def _weights(model_path: Path | None, checkpoint: str | Path | None, random_weights: bool) -> str | Path:
    from executor.weights import WeightsError, has_weights

    if checkpoint is not None and random_weights:
        raise RunError("give checkpoint=DIR or random_weights=True, not both")
    if checkpoint is not None:
        return Path(checkpoint)
    if random_weights:
        return RANDOM_WEIGHTS
    if model_path is not None and has_weights(model_path):
        return model_path
    raise WeightsError("no weights: give a checkpoint directory with safetensors as the model, checkpoint=DIR "
                       "or random_weights=True")


def _tokenizer(explicit: str | Path | None, directory: Path | None) -> Tokenizer | None:
    from executor.tokenizer import Tokenizer, TokenizerError

    if explicit is not None:
        tokenizer = Tokenizer.from_directory(explicit)
        if tokenizer is None:
            raise TokenizerError(f"tokenizer={explicit}: no tokenizer.json there")
        return tokenizer
    return Tokenizer.from_directory(directory) if directory is not None else None


def _per_request(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                 count: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise RunError(f"{len(params)} SamplingParams for {count} prompts: give one, or one per prompt")
    return params


def _output(index: int, prompt: str | None, spec: RequestSpec, result: RequestResult | None,
            text: str | None) -> RequestOutput:
    if result is None:  # rejected before the engine
        return RequestOutput(index, prompt, list(spec.prompt_ids), [], None, "rejected", spec.error)
    return RequestOutput(index, prompt, list(spec.prompt_ids), list(result.output_ids), text, result.finish_reason,
                         result.error, result.ttft_s, tuple(result.token_latencies_s))


def _is_ids(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)
