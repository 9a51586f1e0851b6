"""/v1/responses: OpenAI's Responses API for text, over the chat path (serving_chat.py). The
input items become chat messages (after those of previous_response_id's conversation), the
request a chat request, and the parsed output becomes output items: a reasoning item, a
message, function calls. Streamed, they come as OpenAI's events, in its order:

    response.created, response.in_progress,
    per item: response.output_item.added, (text items) response.content_part.added,
      response.reasoning_text.delta / response.output_text.delta ... and .done,
      response.content_part.done; (calls) response.function_call_arguments.delta ... and .done;
      response.output_item.done,
    response.completed (response.incomplete when max_output_tokens cut it).
"""
import json
from collections.abc import AsyncIterator

from pydantic import ValidationError

from jaxllm.entrypoints.openai.errors import APIError
from jaxllm.entrypoints.openai.output_parser import OutputDelta, ParsedOutput
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest
from jaxllm.entrypoints.openai.request_body import validation_error
from jaxllm.entrypoints.openai.response_store import ResponseStore, StoredResponse
from jaxllm.entrypoints.openai.responses_protocol import (ResponseObject, ResponsesRequest, Usage, function_call_item,
                                                          input_messages, item_id, message_item, output_text,
                                                          reasoning_item, reasoning_text)
from jaxllm.entrypoints.openai.serving import STREAM_ENDINGS, stream_error
from jaxllm.entrypoints.openai.serving_chat import ChatServing, PreparedChat
from jaxllm.entrypoints.openai.tool_parsers import ToolCallDelta

# The chat path names its fields; a Responses request names them so.
_FIELD_NAMES = (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
                ("messages", "input"), ("response_format", "text"), (".function.parameters", ".parameters"),
                ("function.name", "name"))


def _renamed(error: APIError) -> APIError:
    message, param = error.message, error.param
    for chat_name, name in _FIELD_NAMES:
        message = message.replace(chat_name, name)
        param = None if param is None else param.replace(chat_name, name)
    return APIError(error.status, message, param, error.type, error.code)


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id[:100]}' not found.", param=param,
                    type="invalid_request_error")


class ResponsesServing:
    def __init__(self, chat: ChatServing, max_stored_responses: int):
        self.chat, self.base = chat, chat.base
        self.store = ResponseStore(max_stored_responses)
        self._end_id = chat.reasoning_end_token_id

    def get_response(self, response_id: str) -> dict:
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return stored.response

    async def create_response(self, request: ResponsesRequest):
        self.base.check_model(request.model)
        self.base.check_alive()
        history = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id)
            if previous is None:
                raise not_found(request.previous_response_id, "previous_response_id")
            history = previous.messages
        try:
            messages, prepared = await self.base.in_worker(self._prepare, request, history)
        except APIError as e:
            raise _renamed(e) from None
        started = ResponseObject.started(request, item_id("resp"), request.model or self.base.model_names[0])
        requests, firsts = await self.chat.start(started.id, prepared, ResponsesRequest.model_fields)
        if request.stream:
            return self._stream(request, started, prepared, messages, requests, firsts[0].num_cached_tokens)
        requests.close()
        out = firsts[0]
        if out.error is not None:
            raise APIError(500, f"the engine failed the request: {out.error}")
        c = out.outputs[0]
        items = OutputItems()
        items.take(whole_delta(prepared.new_parser().parse(c.text)))
        status = "incomplete" if c.finish_reason == "length" else "completed"
        items.close(status)
        return self._finish(request, started, status, items.items, prepared, list(c.token_ids),
                            out.num_cached_tokens, messages)

    def _prepare(self, request: ResponsesRequest, history: list[dict]) -> tuple[list[dict], PreparedChat]:
        """In a worker thread: the conversation so far, and the chat request made ready."""
        messages = history + input_messages(request.input)
        system = [{"role": "system", "content": request.instructions}] if request.instructions is not None else []
        fields = {"model": request.model, "messages": system + messages, "stream": request.stream,
                  "max_completion_tokens": request.max_output_tokens, "temperature": request.temperature,
                  "top_p": request.top_p, "top_k": request.top_k, "logit_bias": request.logit_bias,
                  "user": request.user, "parallel_tool_calls": request.parallel_tool_calls,
                  "chat_template_kwargs": request.chat_template_kwargs}
        if request.tools is not None:
            fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                               for tool in request.tools]
        if request.tool_choice is not None:
            fields["tool_choice"] = request.tool_choice if isinstance(request.tool_choice, str) else \
                {"type": "function", "function": {"name": request.tool_choice.name}}
        text_format = request.text.format if request.text is not None else None
        if text_format is not None and text_format.type != "text":
            fields["response_format"] = {"type": text_format.type} if text_format.type == "json_object" else \
                {"type": "json_schema", "json_schema": {"name": text_format.name or "response",
                                                        "schema": text_format.json_schema}}
        try:
            chat_request = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            raise validation_error(e) from None
        self.chat.check(chat_request)
        return messages, self.chat.prepare(chat_request)

    def _finish(self, request: ResponsesRequest, started: ResponseObject, status: str, output: list[dict],
                prepared: PreparedChat, token_ids: list[int], num_cached_tokens: int,
                messages: list[dict]) -> ResponseObject:
        """The finished response, kept (unless store is false) with its conversation for the next turn."""
        thought = any(item["type"] == "reasoning" for item in output)
        reasoning_tokens = 0
        if thought:  # the tokens up to and with </think>, or all of them if it never came
            reasoning_tokens = token_ids.index(self._end_id) + 1 if self._end_id in token_ids else len(token_ids)
        num_prompt = len(prepared.token_ids)
        usage = Usage(input_tokens=num_prompt, input_tokens_details={"cached_tokens": num_cached_tokens},
                      output_tokens=len(token_ids), output_tokens_details={"reasoning_tokens": reasoning_tokens},
                      total_tokens=num_prompt + len(token_ids))
        response = started.finished(status, output, usage)
        if request.store:
            self.store.put(response.id, StoredResponse(response.model_dump(), messages + [assistant_turn(output)]))
        return response

    async def _stream(self, request: ResponsesRequest, started: ResponseObject, prepared: PreparedChat,
                      messages: list[dict], requests, num_cached_tokens: int) -> AsyncIterator[str]:
        items, parser = OutputItems(), prepared.new_parser()
        token_ids, finish = [], None
        for kind in ("response.created", "response.in_progress"):
            yield items.event(kind, response=started.model_dump())
        try:
            async for c, delta in self.chat.parsed_outputs(requests, [parser]):
                token_ids += c.token_ids
                for event in items.take(delta):
                    yield event
                finish = c.finish_reason
        except STREAM_ENDINGS as e:
            error = stream_error(e)
            yield items.event("error", code=error.code, message=error.message, param=None)
            return
        finally:
            requests.close()  # also when the client left: the server closes this stream at a yield
        status = "incomplete" if finish == "length" else "completed"
        for event in items.close(status):
            yield event
        response = self._finish(request, started, status, items.items, prepared, token_ids, num_cached_tokens,
                                messages)
        yield items.event(f"response.{status}", response=response.model_dump())


def assistant_turn(output: list[dict]) -> dict:
    """A response's output items as the assistant message of the conversation's next turn."""
    turn = {"role": "assistant", "content": "".join(part["text"] for item in output if item["type"] == "message"
                                                   for part in item["content"])}
    reasoning = [part["text"] for item in output if item["type"] == "reasoning" for part in item["content"]]
    if reasoning:
        turn["reasoning_content"] = "".join(reasoning)
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                     "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if calls:
        turn["tool_calls"] = calls
    return turn


def whole_delta(parsed: ParsedOutput) -> OutputDelta:
    """A whole output as one delta, for OutputItems."""
    calls = []
    for i, call in enumerate(parsed.tool_calls):
        calls += [ToolCallDelta(i, "", call.id, call.name), ToolCallDelta(i, call.arguments)]
    return OutputDelta(parsed.reasoning or "", parsed.content or "", calls)


class OutputItems:
    """A response's output items as deltas of its output arrive, and the events that tell it:
    a reasoning or message item stays open while text of its kind comes; a call opens an item
    of its own. Every event is numbered (sequence_number)."""

    def __init__(self):
        self.items: list[dict] = []
        self._open: dict | None = None  # the item being written
        self._text = ""  # its text so far
        self._seq = 0

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def take(self, delta: OutputDelta) -> list[str]:
        events = []
        if delta.reasoning:
            events += self._write("reasoning", delta.reasoning)
        if delta.content:
            events += self._write("message", delta.content)
        for d in delta.tool_calls:
            if d.id is not None:
                events += self.close("completed", last=False)
                self._add(function_call_item(item_id("fc"), d.id, d.name, "", "in_progress"))
                events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                         item=self._open))
            if d.arguments:
                self._open["arguments"] += d.arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=self._open["id"],
                                         output_index=len(self.items) - 1, delta=d.arguments))
        return events

    def _add(self, item: dict) -> None:
        self.items.append(item)
        self._open, self._text = item, ""

    def _write(self, kind: str, text: str) -> list[str]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self.close("completed", last=False)
            reasoning = kind == "reasoning"
            self._add((reasoning_item if reasoning else message_item)(item_id("rs" if reasoning else "msg"), "",
                                                                      "in_progress"))
            where = {"item_id": self._open["id"], "output_index": len(self.items) - 1, "content_index": 0}
            events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                     item=self._open))
            events.append(self.event("response.content_part.added", **where,
                                     part=reasoning_text("") if reasoning else output_text("")))
        if not text:
            return events
        self._text += text
        where = {"item_id": self._open["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if kind == "reasoning":
            events.append(self.event("response.reasoning_text.delta", **where, delta=text))
        else:
            events.append(self.event("response.output_text.delta", **where, delta=text, logprobs=[]))
        return events

    def close(self, status: str, last: bool = True) -> list[str]:
        """Ends the open item (with `status`); `last`: the output's end, which has at least one item."""
        if last and not self.items:
            return self._write("message", "") + self.close(status)
        item, events = self._open, []
        if item is None:
            return events
        index = len(self.items) - 1
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
        else:
            part = reasoning_text(self._text) if item["type"] == "reasoning" else output_text(self._text)
            if item["type"] == "reasoning":
                events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=self._text))
            else:
                events.append(self.event("response.output_text.done", **where, content_index=0, text=self._text,
                                         logprobs=[]))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
            item["content"] = [part]
        item["status"] = status if last else "completed"
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        self._open = None
        return events
