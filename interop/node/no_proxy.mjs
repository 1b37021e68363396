// Which hosts Node's clients send through the proxy with the shipped NO_PROXY: axios
// (which reads the variables through proxy-from-env) and undici's EnvHttpProxyAgent,
// each deciding with its own code. Their direct connections are refused before a packet
// leaves (axios: an http.Agent whose connections go only to the proxy; undici: the
// direct agent's connector), so nothing leaves loopback.
//
// Run by tests/interop.rs with the JSON plan (the proxy URL, the NO_PROXY value, the
// hosts); prints one JSON line per (client, host): {"client", "host", "via"}.

import { readFileSync } from "node:fs";
import http from "node:http";
import net from "node:net";

import axios from "axios";
import { EnvHttpProxyAgent, fetch } from "undici";

const plan = JSON.parse(readFileSync(process.argv[2], "utf8"));
for (const k of ["HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"]) process.env[k] = plan.proxy;
process.env.NO_PROXY = plan.no_proxy;
process.env.no_proxy = plan.no_proxy;
const proxy = new URL(plan.proxy);

let direct = false;
const refuse = () => {
  direct = true;
  return new Error("a direct connection (refused by the test)");
};

class ProxyOnly extends http.Agent {
  createConnection(options, callback) {
    if (options.host === proxy.hostname && String(options.port) === proxy.port) {
      return net.createConnection({ host: options.host, port: options.port }, callback);
    }
    const socket = new net.Socket();
    process.nextTick(() => socket.destroy(refuse()));
    return socket;
  }
}
const httpAgent = new ProxyOnly();

const clients = {
  axios: async (url) => (await axios.get(url, { httpAgent, validateStatus: () => true, timeout: 5000 })).status,
  undici: async (url) => {
    const dispatcher = new EnvHttpProxyAgent({ proxyTunnel: false, connect: (_opts, cb) => cb(refuse(), null) });
    try {
      return (await fetch(url, { dispatcher })).status;
    } finally {
      await dispatcher.close();
    }
  },
};

for (const [client, get] of Object.entries(clients)) {
  for (const host of plan.hosts) {
    direct = false;
    let status;
    try {
      // Not the discard port of the other scripts: fetch refuses port 9 as a "bad port".
      status = await get(`http://${host}:8080/probe/${client}`);
    } catch (e) {
      status = `${e.name}: ${e.message}`;
    }
    const via = direct ? "direct" : status === 403 ? "proxy" : `error: ${status}`;
    console.log(JSON.stringify({ client, host, via }));
  }
}
