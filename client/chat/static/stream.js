// Streaming a reply from POST /v1/chat/completions: SSE parsed from fetch's ReadableStream, and
// the reply's stats (TTFT and tokens/s measured here; token counts from the final usage chunk).
import {ApiError, errorMessage, headers} from "./api.js";

/** A reply in progress; `note` is what the page shows and stores about the context. */
export function newReply(fields) {
  return {content: "", chunks: 0, usage: null, server: null, finish: null, stopped: false,
          controller: new AbortController(), t0: performance.now(), tFirst: null, tLast: null,
          ...fields};
}

/** Streams `body` into `s`, calling onUpdate(s) per chunk. Stop = s.controller.abort(). */
export async function streamReply(s, body, onUpdate) {
  const res = await fetch("/v1/chat/completions", {method: "POST", headers: headers(),
                                                    body: JSON.stringify(body), signal: s.controller.signal});
  if (!res.ok) throw new ApiError(res.status, await errorMessage(res));
  for await (const chunk of sseEvents(res)) {
    onChunk(s, chunk);
    onUpdate(s);
  }
}

/** Server-sent events of a fetch response, parsed as JSON; ends at `data: [DONE]`. */
async function* sseEvents(res) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buf += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buf.search(/\r?\n\r?\n/)) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + (buf[cut] === "\r" ? 4 : 2));
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

function onChunk(s, c) {
  if (c.error) throw new ApiError(500, c.error.message || "the stream failed");
  for (const ch of c.choices || []) {
    const d = ch.delta && ch.delta.content;
    if (d) {
      const now = performance.now();
      if (s.tFirst === null) s.tFirst = now;
      s.tLast = now;
      s.content += d;
      s.chunks += 1;
    }
    if (ch.finish_reason) s.finish = ch.finish_reason;
  }
  if (c.usage) s.usage = c.usage;
  if (c.triton_llm) s.server = c.triton_llm;
}

export function liveStats(s) {
  const u = s.usage || {};
  const completion = u.completion_tokens ?? s.chunks;
  const end = s.tLast ?? performance.now();
  // Decode rate between the first and last token; when they arrived in one burst (a short reply,
  // a busy network path) that window means nothing, so fall back to the rate over the whole reply.
  let tps = null;
  if (s.tFirst !== null && completion > 1 && end - s.tFirst >= 50) tps = (completion - 1) / ((end - s.tFirst) / 1000);
  else if (completion > 0 && end > s.t0) tps = completion / ((end - s.t0) / 1000);
  return {
    prompt_tokens: u.prompt_tokens ?? null,
    completion_tokens: completion,
    approx_tokens: !s.usage,                 // a stopped stream has no usage chunk: chunks counted
    cached_tokens: (u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens) ?? null,
    ttft_ms: s.tFirst === null ? null : s.tFirst - s.t0,
    tokens_per_s: tps,
    total_ms: end - s.t0,
    server: s.server,
  };
}

