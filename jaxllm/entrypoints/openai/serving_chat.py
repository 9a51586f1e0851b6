"""/v1/chat/completions: the messages (and tools) through the chat template, the output through
the reasoning and tool parsers (output_parser.py), as one response or as Server-Sent Events.

Tools, by vLLM's rules (tool_calling.py): with tool_choice "auto" the server's tool parser
reads the calls the model chose to write; "required" and a named function force a call
with structured outputs, whose output the server reads as calls. With a reasoning parser,
the thinking goes to reasoning_content, and structured outputs (response_format, a forced
call) shape the answer alone: they start after the end of the thinking.
"""
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Callable

from jaxllm.entrypoints.chat_utils import apply_chat_template, chat_messages, content_text
from jaxllm.entrypoints.openai.cli_args import ChatFeatures
from jaxllm.entrypoints.openai.errors import APIError
from jaxllm.entrypoints.openai.output_parser import OutputDelta, OutputParser, ParsedOutput
from jaxllm.entrypoints.openai.prompts import PromptTooLong
from jaxllm.entrypoints.openai.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk,
                                                ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
                                                ChatStreamChoice, DeltaFunctionCall, DeltaMessage, DeltaToolCall,
                                                FunctionCallOut, NamedToolChoice, TokenLogprob, ToolCallOut,
                                                TopLogprob, UsageInfo, random_id)
from jaxllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningParser, thinking_state
from jaxllm.entrypoints.openai.request_streams import RequestFailed, RequestStreams
from jaxllm.entrypoints.openai.serving import OpenAIServing, sse, sse_events, token_text
from jaxllm.entrypoints.openai.tool_calling import (forced_call_schema, resolve_tool_choice, template_messages,
                                                    template_tools)
from jaxllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, NamedToolParser, RequiredToolParser
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import CompletionOutput
from jaxllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


@dataclasses.dataclass
class PreparedChat:
    """A chat request made ready in a worker thread: its prompt, what it may generate, and how
    each of its choices' output is read."""
    prompt: str
    token_ids: list[int]
    max_tokens: int
    params: SamplingParams
    new_parser: Callable[[], OutputParser]
    named_tool: bool  # tool_choice named a function (whose call is reported with finish_reason "stop")
    lora_request: LoRARequest | None = None  # the LoRA adapter its `model` names


def finish_reason(engine_reason: str, tools_called: bool, named_tool: bool) -> str:
    """vLLM's and OpenAI's: "tool_calls" when the model called tools and stopped by itself; a
    call cut at max_tokens stays "length", and a named function's call is "stop"."""
    return "tool_calls" if tools_called and engine_reason == "stop" and not named_tool else engine_reason


class ChatServing:
    def __init__(self, base: OpenAIServing, features: ChatFeatures):
        self.base = base
        self.tool_parser = TOOL_PARSERS[features.tool_call_parser] if features.enable_auto_tool_choice else None
        # With a reasoning parser: whether the output starts in the thinking by default; else None.
        self.thinks_by_default = REASONING_PARSERS.get(features.reasoning_parser)
        self.reasoning_end_token_id = features.reasoning_end_token_id

    def chat_prompt(self, request) -> tuple[str, list[int]]:
        """In a worker thread: the chat template applied to request.messages and .tools
        (ChatCompletionRequest or TokenizeRequest), at most max_model_len tokens."""
        base = self.base
        messages = template_messages(request.messages)
        try:
            return apply_chat_template(
                base.encoder, chat_messages(0, messages),
                getattr(request, "chat_template", None) or base.chat_template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=getattr(request, "continue_final_message", False),
                chat_template_kwargs=request.chat_template_kwargs, tools=template_tools(request.tools))
        except PromptTooLong as e:
            num_chars = sum(len(m["content"]) if isinstance(m["content"], str) else 0 for m in messages)
            raise base.too_long(e, "messages", base.max_model_len, num_chars) from None
        except (ValueError, TypeError) as e:
            text = str(e).replace("conversation 0, message ", "message ").replace("conversation 0 ", "it ")
            raise APIError(400, f"messages: {text}", param="messages") from e

    def check(self, request: ChatCompletionRequest) -> None:
        """What can be checked before the request's work starts."""
        base = self.base
        base.check_model(request.model)
        base.check_stream_options(request)
        base.check_alive()
        if request.max_tokens is not None and request.max_completion_tokens is not None:
            raise APIError(400, "set max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        base.check_num_seqs(1, request.n)

    def prepare(self, request: ChatCompletionRequest) -> PreparedChat:
        """In a worker thread: the tool choice, the chat template applied and tokenized, max_tokens
        and SamplingParams (structured outputs for a forced call), and the output's parser."""
        base = self.base
        choice = resolve_tool_choice(request.tools, request.tool_choice, self.tool_parser is not None)
        text, token_ids = self.chat_prompt(request)
        field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        max_tokens = base.max_tokens(requested, field, len(token_ids), "messages", base.default_fields.get("max_tokens"))
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        prompt_state = None if self.thinks_by_default is None else thinking_state(text)
        overrides = {"structured_outputs": self._structured_outputs(request, choice, prompt_state)}
        if choice == "auto" and self.tool_parser.keeps_special_tokens:
            overrides["skip_special_tokens"] = False  # the calls' tags are special tokens
        params = base.sampling_params(request, max_tokens, logprobs, kind, **overrides)
        new_parser = functools.partial(self._output_parser, choice, prompt_state, request.parallel_tool_calls)
        return PreparedChat(text, token_ids, max_tokens, params, new_parser, isinstance(choice, NamedToolChoice),
                            base.check_model(request.model))

    def _structured_outputs(self, request: ChatCompletionRequest, choice, prompt_state: bool | None):
        structured = self.base.structured_outputs(request)
        schema = forced_call_schema(request.tools, choice, request.parallel_tool_calls)
        if schema is not None:
            if structured is not None:
                raise APIError(400, f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} "
                               "shapes the output: it cannot go with response_format or structured_outputs",
                               param="tool_choice")
            try:  # each tool's schema is fine alone (forced_call_schema checked them): this is rare
                structured = StructuredOutputsParams(json=schema)
            except (ValueError, TypeError) as e:
                raise APIError(400, f"tools: the schema of the calls tool_choice forces is not one structured "
                               f"outputs can follow: {e}", param="tools") from e
        if structured is not None and self.thinks_by_default is not None and prompt_state is not False:
            structured = dataclasses.replace(structured, reasoning_end_token_id=self.reasoning_end_token_id)
        return structured

    def _output_parser(self, choice, prompt_state: bool | None, parallel_tool_calls: bool) -> OutputParser:
        reasoning = None if self.thinks_by_default is None else ReasoningParser(self.thinks_by_default, prompt_state)
        if choice == "auto":
            tools = self.tool_parser()
        elif choice == "required":
            tools = RequiredToolParser()
        elif isinstance(choice, NamedToolChoice):
            tools = NamedToolParser(choice.function.name)
        else:
            tools = None
        return OutputParser(reasoning, tools, parallel_tool_calls)

    async def start(self, request_id: str, prepared: PreparedChat, fields) -> tuple[RequestStreams, list]:
        """The request in the engine, and its first outputs (the engine's checks have passed)."""
        requests = self.base.start(request_id, [(prepared.prompt, prepared.token_ids)], prepared.params,
                                   prepared.max_tokens, prepared.lora_request)
        return requests, await self.base.first_outputs(requests, fields)

    @staticmethod
    async def parsed_outputs(requests: RequestStreams,
                             parsers: list[OutputParser]) -> AsyncIterator[tuple[CompletionOutput, OutputDelta]]:
        """Each new output of the request's choices, and what it was (its choice's parser read
        it; a choice's last output also gives what the parser held back)."""
        async for _, out in requests:
            if out.error is not None:
                raise RequestFailed(out.error)
            for c in out.outputs:
                yield c, parsers[c.index].feed(c.text, final=c.finish_reason is not None)

    async def create_chat_completion(self, request: ChatCompletionRequest):
        self.check(request)
        prepared = await self.base.in_worker(self.prepare, request)
        request_id = random_id("chatcmpl")
        model = request.model or self.base.model_names[0]
        requests, firsts = await self.start(request_id, prepared, ChatCompletionRequest.model_fields)
        top = request.top_logprobs or 0
        if request.stream:
            return sse_events(self._chat_stream(request, request_id, model, prepared, requests, top), requests)
        requests.close()
        out = firsts[0]
        if out.error is not None:
            raise APIError(500, f"the engine failed the request: {out.error}")
        choices, echo = [], echoed_text(request)
        for c in sorted(out.outputs, key=lambda c: c.index):
            parsed = prepared.new_parser().parse(c.text)
            message = assistant_message(parsed)
            if echo:
                message.content = echo + (message.content or "")
            choices.append(ChatChoice(index=c.index, message=message,
                                      logprobs=None if c.logprobs is None else chat_logprobs(c, top),
                                      finish_reason=finish_reason(c.finish_reason, bool(parsed.tool_calls),
                                                                  prepared.named_tool),
                                      stop_reason=c.stop_reason))
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        num_prompt_tokens = len(prepared.token_ids)
        return ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=UsageInfo(prompt_tokens=num_prompt_tokens,
                                                      completion_tokens=completion_tokens,
                                                      total_tokens=num_prompt_tokens + completion_tokens))

    async def _chat_stream(self, request: ChatCompletionRequest, request_id: str, model: str,
                           prepared: PreparedChat, requests: RequestStreams, top: int) -> AsyncIterator[str]:
        created = int(time.time())
        options = request.stream_options
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options.continuous_usage_stats
        prompt_tokens, completion_tokens = len(prepared.token_ids), 0
        parsers = [prepared.new_parser() for _ in range(request.n)]

        def usage():
            return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                             total_tokens=prompt_tokens + completion_tokens)

        echo = echoed_text(request)
        for index in range(request.n):
            for delta in [DeltaMessage(role="assistant", content="")] + ([DeltaMessage(content=echo)] if echo else []):
                chunk = ChatCompletionChunk(id=request_id, created=created, model=model,
                                            choices=[ChatStreamChoice(index=index, delta=delta)],
                                            usage=usage() if continuous else None)
                yield sse(chunk.model_dump_json())
        async for c, delta in self.parsed_outputs(requests, parsers):
            completion_tokens += len(c.token_ids)
            if not delta and c.finish_reason is None and not (c.token_ids and c.logprobs):
                continue
            finish = None if c.finish_reason is None else \
                finish_reason(c.finish_reason, parsers[c.index].tools_called, prepared.named_tool)
            choice = ChatStreamChoice(index=c.index, delta=delta_message(delta),
                                      logprobs=None if c.logprobs is None else chat_logprobs(c, top),
                                      finish_reason=finish, stop_reason=c.stop_reason)
            chunk = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice],
                                        usage=usage() if continuous else None)
            yield sse(chunk.model_dump_json())
        if include_usage:
            chunk = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[], usage=usage())
            yield sse(chunk.model_dump_json())


def echoed_text(request: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's text when it is the assistant's (the reply goes on
    from it, as with continue_final_message), which the reply's content then starts with; else ""."""
    last = request.messages[-1] if request.messages else None
    if not request.echo or last is None or last.role != "assistant" or last.content is None:
        return ""
    return content_text("messages[-1]", last.content)


def assistant_message(parsed: ParsedOutput) -> AssistantMessage:
    calls = [ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))
             for call in parsed.tool_calls]
    return AssistantMessage(content=parsed.content, reasoning_content=parsed.reasoning, reasoning=parsed.reasoning,
                            tool_calls=calls)


def delta_message(delta: OutputDelta) -> DeltaMessage:
    calls = [DeltaToolCall(index=d.index, id=d.id, type=None if d.id is None else "function",
                           function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
             for d in delta.tool_calls]
    plain = not (delta.reasoning or calls)  # a piece of plain text, or nothing: content, "" too
    return DeltaMessage(content=delta.content if delta.content or plain else None,
                        reasoning_content=delta.reasoning or None, reasoning=delta.reasoning or None,
                        tool_calls=calls or None)


def chat_logprobs(c: CompletionOutput, top: int) -> ChatLogprobs:
    content = []
    for token_id, entries in zip(c.token_ids, c.logprobs):
        sampled = entries[token_id]
        text = token_text(token_id, sampled)
        best = sorted(entries.items(), key=lambda e: e[1].rank if e[1].rank is not None else 0)[:top]
        content.append(TokenLogprob(token=text, logprob=sampled.logprob, bytes=list(text.encode()),
                                    top_logprobs=[TopLogprob(token=token_text(t, lp), logprob=lp.logprob,
                                                             bytes=list(token_text(t, lp).encode()))
                                                  for t, lp in best]))
    return ChatLogprobs(content=content)
