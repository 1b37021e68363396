// Node.js clients through sluice, as users configure them: undici (fetch with a
// ProxyAgent; for http://, EnvHttpProxyAgent from HTTP_PROXY with proxyTunnel: false, so
// that it sends absolute-form requests instead of CONNECT tunnels), axios (its proxy
// option for http://, https-proxy-agent for https://) and ws (with http-proxy-agent /
// https-proxy-agent), each in the three modes.
//
// Run by tests/interop.rs with the JSON plan as its one argument; prints one JSON line
// per check: {"client", "mode", "check", "ok", "detail"}.

import { createHash, randomBytes, randomUUID } from "node:crypto";
import { readFileSync } from "node:fs";

import axios from "axios";
import { HttpProxyAgent } from "http-proxy-agent";
import { HttpsProxyAgent } from "https-proxy-agent";
import { EnvHttpProxyAgent, ProxyAgent, fetch } from "undici";
import WebSocket from "ws";

const plan = JSON.parse(readFileSync(process.argv[2], "utf8"));
const PROXY = plan.proxy;
const CA = {
  forward: undefined,
  intercept: readFileSync(plan.sluice_ca, "utf8"),
  tunnel: readFileSync(plan.upstream_ca, "utf8"),
};
const MB = randomBytes(1 << 20);
const MB_SHA = createHash("sha256").update(MB).digest("hex");

function report(client, mode, check, ok, detail = "") {
  console.log(JSON.stringify({ client, mode, check, ok: !!ok, detail: String(detail).slice(0, 300) }));
}

async function run(client, mode, check, fn) {
  let ok, detail;
  try {
    [ok, detail] = await fn();
  } catch (e) {
    [ok, detail] = [false, `${e.name}: ${e.message} ${e.cause ?? ""}`];
  }
  report(client, mode, check, ok, detail);
}

function chunked() {
  let i = 0;
  return new ReadableStream({
    pull(controller) {
      if (i >= MB.length) return controller.close();
      controller.enqueue(MB.subarray(i, i + (64 << 10)));
      i += 64 << 10;
    },
  });
}

async function undiciSuite(mode, base) {
  // The recipe of docs/kubernetes.md for http://: the proxy variables, and no tunnel.
  process.env.HTTP_PROXY = PROXY;
  process.env.NO_PROXY = "";
  const dispatcher = mode === "forward"
    ? new EnvHttpProxyAgent({ proxyTunnel: false })
    : new ProxyAgent({ uri: PROXY, requestTls: CA[mode] ? { ca: CA[mode] } : undefined });
  const call = (url, init = {}) => fetch(url, { dispatcher, ...init });
  const c = "undici";
  if (mode === "forward") {
    // A CONNECT to a refused host fails inside undici ("Proxy response (403) !== 200");
    // an absolute-form request gets sluice's own 403 as its response.
    await run(c, mode, "http:// sent in absolute form, not through CONNECT", async () => {
      const r = await call(plan.denied_url);
      return [r.status === 403 && r.headers.get("sluice-reason") === "denied", `${r.status} ${r.headers.get("sluice-reason")}`];
    });
  }
  await run(c, mode, "method, path, headers and body intact", async () => {
    const r = await call(`${base}/inspect/a/b?q=1`, { method: "POST", body: "hello", headers: { "X-Interop": "yes" } });
    const v = await r.json();
    return [r.status === 200 && v.method === "POST" && v.path === "/inspect/a/b" && v.query === "q=1"
      && v.headers["x-interop"] === "yes" && v.body_len === 5, JSON.stringify(v)];
  });
  await run(c, mode, "keep-alive", async () => {
    const s = [];
    for (let i = 0; i < 3; i++) {
      const r = await call(`${base}/inspect/k${i}`);
      await r.arrayBuffer();
      s.push(r.status);
    }
    return [s.join() === "200,200,200", s];
  });
  await run(c, mode, "1 MiB upload", async () => {
    const v = await (await call(`${base}/inspect/upload`, { method: "POST", body: MB })).json();
    return [v.body_sha256 === MB_SHA, v.body_len];
  });
  await run(c, mode, "chunked upload", async () => {
    const r = await call(`${base}/inspect/chunked`, { method: "POST", body: chunked(), duplex: "half" });
    const v = await r.json();
    return [v.body_sha256 === MB_SHA, `${v.body_len} ${v.headers["transfer-encoding"]}`];
  });
  await run(c, mode, "HEAD, 204, 304", async () => {
    const got = [
      (await call(`${base}/inspect/h`, { method: "HEAD" })).status,
      (await call(`${base}/status/204`)).status,
      (await call(`${base}/status/304`)).status,
    ];
    return [got.join() === "200,204,304", got];
  });
  await run(c, mode, "streamed response", async () => {
    const t = performance.now();
    const r = await call(`${base}/drip/4/300`);
    const reader = r.body.getReader();
    await reader.read();
    const first = performance.now() - t;
    while (!(await reader.read()).done);
    const total = performance.now() - t;
    return [first < 0.8 * total, `first chunk after ${first.toFixed(0)} of ${total.toFixed(0)} ms`];
  });
  await run(c, mode, mode === "tunnel" ? "a 429 passed through as sent" : "429 retried for GET, not for a POST without a key", async () => {
    const name = randomUUID();
    const g = await call(`${base}/seq/${name}g/429,200`);
    await g.arrayBuffer();
    if (mode === "tunnel") return [g.status === 429 && !g.headers.get("sluice-attempts"), g.status];
    const p = await call(`${base}/seq/${name}p/429,200`, { method: "POST", body: "order" });
    await p.arrayBuffer();
    return [g.status === 200 && g.headers.get("sluice-attempts") === "2" && p.status === 429,
      [g.status, g.headers.get("sluice-attempts"), p.status]];
  });
}

async function axiosSuite(mode, base) {
  const u = new URL(PROXY);
  const config = base.startsWith("https")
    ? { proxy: false, httpsAgent: new HttpsProxyAgent(PROXY, { ca: CA[mode] }) }
    : { proxy: { protocol: "http", host: u.hostname, port: Number(u.port) } };
  const ax = axios.create({ ...config, validateStatus: () => true, maxBodyLength: Infinity, maxContentLength: Infinity });
  const c = "axios";
  await run(c, mode, "method, path, headers and body intact", async () => {
    const r = await ax.post(`${base}/inspect/a/b?q=1`, "hello", { headers: { "X-Interop": "yes", "Content-Type": "text/plain" } });
    const v = r.data;
    return [r.status === 200 && v.method === "POST" && v.path === "/inspect/a/b" && v.headers["x-interop"] === "yes"
      && v.body_len === 5, JSON.stringify(v)];
  });
  await run(c, mode, "1 MiB upload", async () => {
    const r = await ax.post(`${base}/inspect/upload`, MB, { headers: { "Content-Type": "application/octet-stream" } });
    return [r.data.body_sha256 === MB_SHA, r.data.body_len];
  });
  await run(c, mode, "HEAD, 204, 304", async () => {
    const got = [(await ax.head(`${base}/inspect/h`)).status, (await ax.get(`${base}/status/204`)).status,
      (await ax.get(`${base}/status/304`)).status];
    return [got.join() === "200,204,304", got];
  });
  await run(c, mode, mode === "tunnel" ? "a 429 passed through as sent" : "429 retried for GET, not for a POST without a key", async () => {
    const name = randomUUID();
    const g = await ax.get(`${base}/seq/${name}g/429,200`);
    if (mode === "tunnel") return [g.status === 429 && !g.headers["sluice-attempts"], g.status];
    const p = await ax.post(`${base}/seq/${name}p/429,200`, "order");
    return [g.status === 200 && g.headers["sluice-attempts"] === "2" && p.status === 429,
      [g.status, g.headers["sluice-attempts"], p.status]];
  });
}

async function wsSuite(mode, url) {
  const agent = url.startsWith("wss") ? new HttpsProxyAgent(PROXY, { ca: CA[mode] }) : new HttpProxyAgent(PROXY);
  await run("ws", mode, "WebSocket", () => new Promise((resolve) => {
    const w = new WebSocket(url, { agent, ca: CA[mode] });
    const timer = setTimeout(() => { w.terminate(); resolve([false, "no echo within 10 s"]); }, 10000);
    w.on("open", () => w.send("hello"));
    w.on("message", (data) => {
      clearTimeout(timer);
      w.close();
      resolve([data.toString() === "hello", data.toString()]);
    });
    w.on("error", (e) => { clearTimeout(timer); resolve([false, `${e.name}: ${e.message}`]); });
  }));
}

for (const [mode, m] of Object.entries(plan.modes)) {
  await undiciSuite(mode, m.base);
  await axiosSuite(mode, m.base_named);
  // axios and ws by name: https-proxy-agent checks an IP literal's certificate against
  // "localhost".
  await wsSuite(mode, m.ws_named);
}
process.exit(0);
