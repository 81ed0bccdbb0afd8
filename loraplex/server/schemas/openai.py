"""OpenAI API request and response bodies (the subset loraplex serves). Requests are strict:
an unknown field is a 400 naming it (as OpenAI answers), known fields that do not change the
output (user, metadata, store, ...) are accepted and ignored, and known features loraplex does
not implement (penalties, audio, ...) are refused by name rather than ignored. vLLM's
request extensions that the field's clients send are taken with vLLM's meaning where loraplex
implements them, accepted at their neutral value only where it does not (docs/api.md lists
them)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from loraplex.server.schemas.client_body import ClientBody
from loraplex.types import MAX_LOGPROBS, MAX_STOP_SEQUENCES

MAX_STOP_LENGTH = 256
MAX_STOP_TOKEN_IDS = 64
MAX_N = 16
MAX_DOCUMENTS = 16
"""Most choices (`n`) one request may ask for."""

Ignored = Annotated[Any, Field(default=None, description="Accepted and ignored.")]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


def unsupported() -> Any:
    return Field(None, description="Not supported: only the value shown is accepted.")


def vllm_neutral() -> Any:
    return Field(None, description="vLLM extension, not implemented: only its neutral value (shown) "
                 "is accepted.")


class Request(ClientBody):
    """A request body: unknown fields and text that is not valid Unicode are refused."""


class StreamOptions(Request):
    include_usage: bool | None = Field(None, description="Send a last chunk with the usage of "
                                       "the whole request and `choices: []`.")
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM extension: every chunk also carries the usage so far (prompt "
        "tokens, tokens generated up to it). Implies `include_usage` unless that is false.")
    include_obfuscation: Ignored

    @model_validator(mode="after")
    def _usage_for_continuous_stats(self) -> StreamOptions:
        if self.continuous_usage_stats and self.include_usage is False:
            raise PydanticCustomError("invalid_value", "continuous_usage_stats needs include_usage")
        return self


JsonValue = dict[str, Any] | bool


class JsonSchemaFormat(Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$",
                      description="The schema's name (OpenAI requires one).")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON schema the "
                                           "output follows (missing: any JSON object).")
    strict: bool | None = Field(None, description="Accepted: the output always follows the schema "
                                "(every token is drawn from those the schema allows).")


class ResponseFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="With `type: json_schema`.")

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("invalid_value", "json_schema is given with type json_schema, "
                                      "and only then")
        return self


class StructuredOutputs(Request):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: JsonValue | str | None = Field(None, alias="json", description="A JSON schema (an object "
                                          "or its JSON text).")
    regex: str | None = Field(None, min_length=1)
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: str | None = Field(None, min_length=1, description="An EBNF grammar (GBNF), rule `root` first.")
    json_object: bool | None = None


class StreamingWindowBody(Request):
    """Attention sinks (StreamingLLM) for this request."""

    sliding_window: int = Field(ge=1, description="Recent tokens whose KV is kept.")
    attention_sinks: int = Field(4, ge=0, description="First tokens whose KV is always kept (in whole "
                                 "KV blocks); 0: a plain sliding window.")


class SamplingFields(Request):
    """What completions and chat share. Features loraplex lacks are refused unless they are
    given their neutral value (penalties 0, an empty logit_bias, ...)."""

    model: str = Field(description="The base model's id, or the name of one of your adapters.",
                       min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=0, description="Most tokens to generate (the server's cap "
                                   "and the context length bound it too). 0 only scores the prompt "
                                   "(with `echo` or `prompt_logprobs`).")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy. Default 1.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling. Default 1.")
    top_k: int | None = Field(None, ge=-1, description="loraplex extension: keep the k most "
                              "likely tokens (-1 or 0: all).")
    ignore_eos: bool | None = Field(None, description="loraplex extension (as vLLM's): keep "
                                    "generating past the end-of-sequence token.")
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)
                              ] | None = Field(None, description="vLLM extension: token ids that end "
                                               "the output (included in it, as vLLM does).")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="vLLM extension: return each prompt token's "
        "log-probability, rank and this many alternatives (`prompt_logprobs` in the answer; "
        "not with `stream`).")
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="vLLM extension: keep only "
                                               "the prompt's last this many tokens.")
    min_tokens: Literal[0] | None = vllm_neutral()
    repetition_penalty: Literal[1] | None = vllm_neutral()
    min_p: Literal[0] | None = vllm_neutral()
    use_beam_search: Literal[False] | None = vllm_neutral()
    length_penalty: Literal[1] | None = vllm_neutral()
    include_stop_str_in_output: Literal[False] | None = vllm_neutral()
    skip_special_tokens: Literal[True] | None = vllm_neutral()
    spaces_between_special_tokens: Literal[True] | None = vllm_neutral()
    priority: Literal[0] | None = vllm_neutral()
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = Field(
        None, description=f"Choices to generate, at most {MAX_N}: samples of one prompt, whose KV they "
                          "share. A `seed` gives choice i the seed `seed + i`.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)] | None = Field(
        None, description=f"Up to {MAX_STOP_SEQUENCES} strings that end the output (not included).")
    seed: int | None = Field(None, description="The same seed, prompt and model give the same output.")
    system_prompt: str | None = Field(
        None, min_length=1, max_length=256, description="loraplex extension: the name of one of your "
        "registered system prompts, put first (chat: as the system message; completions: before the "
        "prompt). Its KV cache is computed once and shared. A prompt bound to an adapter serves only "
        "with that adapter as `model`.")
    documents: Annotated[list[Annotated[str, Field(min_length=1, max_length=64)]],
                         Field(min_length=1, max_length=MAX_DOCUMENTS)] | None = Field(
        None, description=f"loraplex extension: up to {MAX_DOCUMENTS} of your registered documents, by "
        "name, included in this order, each followed by a blank line: chat puts them at the start of "
        "the last user message, completions before the prompt. Each document's KV is computed once "
        "and reused wherever it lands (CacheBlend: a share of its tokens is computed again). A "
        "request that names none has your documents whose text its prompt holds blended alike.")
    documents_blend: bool | None = Field(None, description="loraplex extension: false computes the "
                                         "documents' KV in full, as any prompt's, and looks for no "
                                         "document in the prompt (default true).")
    documents_recompute_share: float | None = Field(
        None, ge=0, le=1, description="loraplex extension: the share of reused document tokens whose KV "
        "is computed again, those the prompt's own tokens (its question) attend to most (default 0.2; 1 is a "
        "full prefill).")
    response_format: ResponseFormat | None = Field(
        None, description="`text`; `json_object` (the output is a JSON object); `json_schema` (it "
        "follows `json_schema.schema`). On completions too, as vLLM takes it.")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM extension: constrain the output to a JSON schema (`json`), a "
        "regular expression, one of a `choice` of strings, or an EBNF `grammar`.")
    guided_json: JsonValue | str | None = Field(None, description="vLLM extension (older name): "
                                                "`structured_outputs.json`.")
    guided_regex: str | None = Field(None, min_length=1, description="vLLM extension (older name).")
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = Field(
        None, description="vLLM extension (older name).")
    guided_grammar: str | None = Field(None, min_length=1, description="vLLM extension (older name).")
    streaming_window: StreamingWindowBody | None = Field(
        None, description="loraplex extension: attention sinks (StreamingLLM): the request's KV keeps "
        "its first `attention_sinks` tokens and its last `sliding_window`, so it may run past the "
        "context (keys at their positions within the cache). Default: the server's `--sliding-window`, "
        "if set.")
    frequency_penalty: Literal[0] | None = unsupported()
    presence_penalty: Literal[0] | None = unsupported()
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = unsupported()
    user: Ignored

    @property
    def include_usage(self) -> bool:
        options = self.stream_options
        return bool(options and (options.include_usage or options.continuous_usage_stats))

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    prompt: Text | TokenIds | Annotated[list[Text], Field(min_length=1, max_length=1)] | Annotated[
        list[TokenIds], Field(min_length=1, max_length=1)] = Field(
        description="One prompt: text or token ids (a list holding one of them is accepted).")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Return the log-probability "
                                 "of each token and of this many alternatives.")
    echo: bool | None = Field(None, description="Return the prompt before the completion; with "
                              "`logprobs`, the prompt tokens' log-probabilities too (the first "
                              "token's is null). With `max_tokens: 0`: the prompt only, scored.")
    add_special_tokens: bool | None = Field(None, description="vLLM extension: add the tokenizer's "
                                            "special tokens (BOS) to a text prompt. Default true.")
    suffix: Annotated[str, Field(max_length=0)] | None = unsupported()
    best_of: Literal[1] | None = unsupported()

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value


class TextPart(Request):
    type: Literal["text"]
    text: str


MAX_TOOLS = 128
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionDefinition(Request):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments "
                                              "(missing: no arguments).")
    strict: bool | None = Field(None, description="Accepted: with `tool_choice` `required` or a named "
                                "function, the arguments always follow `parameters`.")


class Tool(Request):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(Request):
    name: FunctionName


class NamedToolChoice(Request):
    type: Literal["function"]
    function: ChosenFunction


class FunctionCall(Request):
    name: FunctionName
    arguments: str = Field(description="The arguments, as JSON text.")


class ToolCall(Request):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None, description="Text, or a list of text parts "
                                                 "(null only for an assistant's tool calls).")
    name: str | None = Field(None, max_length=64)
    tool_calls: Annotated[list[ToolCall], Field(min_length=1, max_length=MAX_TOOLS)] | None = Field(
        None, description="An assistant's calls of your tools.")
    tool_call_id: str | None = Field(None, min_length=1, max_length=256, description="A `tool` "
                                     "message's answer to this call.")

    @model_validator(mode="after")
    def _content_unless_tool_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("missing", "content is required (it may be null only for an "
                                      "assistant message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("invalid_value", "only assistant messages have tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise PydanticCustomError("invalid_value", "a tool message, and only a tool message, "
                                      "has a tool_call_id")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0, description="Same as max_tokens.")
    logprobs: bool | None = Field(None, description="Return the log-probability of each token.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Literal[1] | None = vllm_neutral()
    echo: Literal[False] | None = vllm_neutral()
    add_generation_prompt: Literal[True] | None = vllm_neutral()
    continue_final_message: Literal[False] | None = vllm_neutral()
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="Functions the model may call, rendered through the chat template (or, if "
        "the template takes no tools, in a system message).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="`auto` (default with tools): the model may answer or call tools; "
        "`required`: it calls one or more (arguments constrained by their schemas); a named "
        "function: it calls that one; `none`: it answers in text.")
    parallel_tool_calls: bool | None = Field(None, description="With false, at most one call.")
    functions: Annotated[list[Any], Field(max_length=0)] | None = unsupported()
    function_call: Literal["none", "auto"] | None = None
    modalities: list[Literal["text"]] | None = None
    audio: None = unsupported()
    prediction: None = unsupported()
    web_search_options: None = unsupported()
    metadata: Ignored
    store: Ignored
    service_tier: Ignored
    reasoning_effort: Ignored
    verbosity: Ignored
    safety_identifier: Ignored
    prompt_cache_key: Ignored
    prompt_cache_options: Ignored
    prompt_cache_retention: Ignored
    moderation: Ignored


# Responses ------------------------------------------------------------------------------------
FinishReason = Literal["stop", "length", "tool_calls"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null for an echoed prompt's first token.")
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's form of one token's entry in `prompt_logprobs`."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""One entry per prompt token (null for the first): token id -> its entry, for the prompt's
own token and the top alternatives."""


class _Envelope(BaseModel):
    """What every completion response and chunk carries besides its choices."""

    id: str
    created: int
    model: str
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None
    prompt_logprobs: PromptLogprobs | None = None


class Completion(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    parent: str | None = Field(description="For an adapter, the base model's id; null for the "
                               "base model.")
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail
