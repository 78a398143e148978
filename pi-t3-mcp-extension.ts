// Written by t3: forwards t3's MCP tools into pi (pi has no MCP client). Do not edit.
import type { ExtensionAPI } from "@mariozechner/pi-coding-agent";
import { Type } from "typebox";

const URL_ = process.env.T3_MCP_URL ?? "";
const TOKEN = process.env.T3_MCP_BEARER_TOKEN ?? "";
const PREFIX = "mcp__t3-code__";
let nextId = 1;
let sessionId: string | undefined;

function post(message: Record<string, unknown>, signal?: AbortSignal): Promise<Response> {
  return fetch(URL_, {
    method: "POST", signal,
    headers: {
      "content-type": "application/json", accept: "application/json, text/event-stream",
      authorization: `Bearer ${TOKEN}`, "mcp-protocol-version": "2025-06-18",
      ...(sessionId ? { "mcp-session-id": sessionId } : {}),
    },
    body: JSON.stringify({ jsonrpc: "2.0", ...message }),
  });
}

async function rpc(method: string, params: unknown, signal?: AbortSignal): Promise<any> {
  const res = await post({ id: nextId++, method, params }, signal);
  const sid = res.headers.get("mcp-session-id");
  if (sid) sessionId = sid;
  const body = await res.text();
  if (!res.ok) throw new Error(`t3 MCP ${method}: HTTP ${res.status}: ${body.slice(0, 500)}`);
  let message: any;
  if ((res.headers.get("content-type") ?? "").includes("text/event-stream")) {
    for (const line of body.split("\n")) {
      if (!line.startsWith("data:")) continue;
      const data = JSON.parse(line.slice(5).trim());
      if (data && data.id !== undefined && (data.result !== undefined || data.error !== undefined)) message = data;
    }
  } else {
    message = JSON.parse(body);
  }
  if (!message) throw new Error(`t3 MCP ${method}: no response`);
  if (message.error) throw new Error(`t3 MCP ${method}: ${message.error.message ?? JSON.stringify(message.error)}`);
  return message.result;
}

export default async function (pi: ExtensionAPI) {
  if (!URL_) return;
  await rpc("initialize", {
    protocolVersion: "2025-06-18", capabilities: {},
    clientInfo: { name: "t3-pi-bridge", version: "0.1.0" },
  });
  await post({ method: "notifications/initialized" }).then((r) => r.text()).catch(() => undefined);
  const listed = await rpc("tools/list", {});
  for (const tool of listed?.tools ?? []) {
    const schema = tool.inputSchema ?? { type: "object", properties: {} };
    pi.registerTool({
      name: PREFIX + tool.name,
      label: tool.title ?? tool.name,
      description: tool.description ?? tool.name,
      parameters: Type.Unsafe(schema),
      async execute(_toolCallId: string, params: any, signal?: AbortSignal) {
        const result = await rpc("tools/call", { name: tool.name, arguments: params ?? {} }, signal);
        let content = (result?.content ?? []).filter((c: any) => c && c.type === "text");
        if (content.length === 0) content = [{ type: "text", text: JSON.stringify(result?.structuredContent ?? result ?? null) }];
        if (result?.isError) throw new Error(content.map((c: any) => c.text).join("\n"));
        return { content, details: { structuredContent: result?.structuredContent } };
      },
    } as any);
  }
}
