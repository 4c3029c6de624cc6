"""``POST /v1/responses`` (OpenAI's Responses API) on the chat generation path.

The body becomes a chat request (client/shim/responses_schema.py), generated like any chat
completion (client/shim/generation.py), and answered in the Responses shape
(client/shim/responses_format.py). ``previous_response_id`` continues a stored conversation of the
same tenant (client/shim/response_store.py); ``store: false`` keeps nothing.
"""
from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request

from client.shim.errors import OpenAIError, invalid
from client.shim.reasoning import parses_reasoning
from client.shim.responses_format import ResponsesTally
from client.shim.responses_schema import ResponsesRequest, to_chat
from client.shim.generation import adapter_for, respond_chat
from client.shim.tenants import KeyPolicy, authenticated
from client.shim.tools import parses_tool_calls
from client.shim.turn import assistant_message

router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, key: KeyPolicy = Depends(authenticated)):
    adapter_for(request.app.state, body.model)         # 404 unless served (or an adapter)
    body.check_supported()
    state = request.app.state
    store = state.response_store
    history: list[dict] = []
    if body.previous_response_id:
        found = store.get(key.tenant, body.previous_response_id)
        if found is None:
            raise invalid(f"Previous response with id '{body.previous_response_id}' not found.",
                          "previous_response_id", "previous_response_not_found")
        history = found
    chat, conversation = to_chat(body, history)
    rid = f"resp_{uuid.uuid4().hex}"

    def keep(turn, response: dict) -> None:
        if body.store is not False:
            store.put(key.tenant, rid, conversation + [assistant_message(turn)], response)

    tally = ResponsesTally(request_id=rid, body=body, reasoning=parses_reasoning(state.settings.reasoning_parser, chat),
                           tools=parses_tool_calls(chat), on_done=keep)
    return await respond_chat(request, key, chat, tally, body.param_names(), "input")


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, key: KeyPolicy = Depends(authenticated)):
    body = request.app.state.response_store.body(key.tenant, response_id)
    if body is None:
        raise OpenAIError(404, f"No response with id '{response_id}' found.", "invalid_request_error",
                          "response_id", "not_found")
    return body


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request, key: KeyPolicy = Depends(authenticated)):
    if not request.app.state.response_store.delete(key.tenant, response_id):
        raise OpenAIError(404, f"No response with id '{response_id}' found.", "invalid_request_error",
                          "response_id", "not_found")
    return {"id": response_id, "object": "response.deleted", "deleted": True}
