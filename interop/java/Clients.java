// Java 17's HttpClient through sluice, as users configure it: a ProxySelector for the
// proxy and an SSLContext that trusts sluice's CA (and the upstreams'), in the three
// modes; HTTP/2 where the tunnel offers it (the client's default), `expectContinue`,
// and its WebSocket client.
//
// Run by tests/interop.rs: `java -cp DIR Clients PLAN.json`, with the CAs to trust in the
// PEM file SLUICE_INTEROP_BUNDLE names. Prints one JSON
// line per check: {"client", "mode", "check", "ok", "detail"}. The plan is read with a
// few regular expressions: the JDK has no JSON parser.

import java.io.ByteArrayInputStream;
import java.io.InputStream;
import java.net.InetSocketAddress;
import java.net.ProxySelector;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.net.http.WebSocket;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.KeyStore;
import java.security.MessageDigest;
import java.security.SecureRandom;
import java.security.cert.Certificate;
import java.security.cert.CertificateFactory;
import java.time.Duration;
import java.util.HexFormat;
import java.util.List;
import java.util.UUID;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionStage;
import java.util.concurrent.TimeUnit;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import javax.net.ssl.SSLContext;
import javax.net.ssl.TrustManagerFactory;

public class Clients {
    static final String C = "java HttpClient";
    static byte[] MB = new byte[1 << 20];
    static String MB_SHA;

    interface Check {
        Object[] run() throws Exception;
    }

    static String quote(String s) {
        return "\"" + s.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", " ") + "\"";
    }

    static void run(String mode, String check, Check fn) {
        boolean ok;
        String detail;
        try {
            Object[] r = fn.run();
            ok = (Boolean) r[0];
            detail = String.valueOf(r[1]);
        } catch (Exception e) {
            ok = false;
            Throwable t = e.getCause() != null ? e.getCause() : e;
            detail = t instanceof java.net.http.WebSocketHandshakeException h
                    ? "handshake answered " + h.getResponse().statusCode() + " " + h.getResponse().headers().map()
                    : e.toString();
        }
        if (detail.length() > 300) detail = detail.substring(0, 300);
        System.out.println("{\"client\": " + quote(C) + ", \"mode\": " + quote(mode) + ", \"check\": "
                + quote(check) + ", \"ok\": " + ok + ", \"detail\": " + quote(detail) + "}");
    }

    static String field(String json, String key) {
        Matcher m = Pattern.compile("\"" + key + "\":\\s*\"([^\"]*)\"").matcher(json);
        return m.find() ? m.group(1) : null;
    }

    static String number(String json, String key) {
        Matcher m = Pattern.compile("\"" + key + "\":\\s*(\\d+)").matcher(json);
        return m.find() ? m.group(1) : null;
    }

    static String sha(byte[] b) throws Exception {
        return HexFormat.of().formatHex(MessageDigest.getInstance("SHA-256").digest(b));
    }

    public static void main(String[] args) throws Exception {
        String plan = Files.readString(Path.of(args[0]));
        new SecureRandom().nextBytes(MB);
        MB_SHA = sha(MB);
        URI proxy = URI.create(field(plan, "proxy"));
        KeyStore trust = KeyStore.getInstance(KeyStore.getDefaultType());
        trust.load(null, null);
        CertificateFactory cf = CertificateFactory.getInstance("X.509");
        int i = 0;
        Path bundle = Path.of(System.getenv("SLUICE_INTEROP_BUNDLE"));
        for (Certificate c : cf.generateCertificates(Files.newInputStream(bundle))) {
            trust.setCertificateEntry("ca" + i++, c);
        }
        TrustManagerFactory tmf = TrustManagerFactory.getInstance(TrustManagerFactory.getDefaultAlgorithm());
        tmf.init(trust);
        SSLContext ssl = SSLContext.getInstance("TLS");
        ssl.init(null, tmf.getTrustManagers(), null);
        HttpClient client = HttpClient.newBuilder()
                .proxy(ProxySelector.of(new InetSocketAddress(proxy.getHost(), proxy.getPort())))
                .sslContext(ssl)
                .connectTimeout(Duration.ofSeconds(10))
                .build();
        for (String mode : List.of("forward", "intercept", "tunnel")) {
            Matcher m = Pattern.compile("\"" + mode + "\":\\s*\\{[^}]*\"base_named\":\\s*\"([^\"]+)\"[^}]*\"ws_named\":\\s*\"([^\"]+)\"")
                    .matcher(plan);
            if (!m.find()) {
                run(mode, "plan", () -> new Object[] {false, "no base_named/ws_named for " + mode});
                continue;
            }
            suite(client, mode, m.group(1), m.group(2));
        }
    }

    static HttpResponse<byte[]> send(HttpClient c, HttpRequest r) throws Exception {
        return c.send(r, HttpResponse.BodyHandlers.ofByteArray());
    }

    static HttpRequest.Builder req(String url) {
        return HttpRequest.newBuilder(URI.create(url)).timeout(Duration.ofSeconds(30));
    }

    static void suite(HttpClient c, String mode, String base, String ws) {
        run(mode, "method, path, headers and body intact", () -> {
            HttpResponse<byte[]> r = send(c, req(base + "/inspect/a/b?q=1").header("X-Interop", "yes")
                    .POST(HttpRequest.BodyPublishers.ofString("hello")).build());
            String v = new String(r.body());
            boolean ok = r.statusCode() == 200 && "POST".equals(field(v, "method"))
                    && "/inspect/a/b".equals(field(v, "path")) && "yes".equals(field(v, "x-interop"))
                    && "5".equals(number(v, "body_len"));
            return new Object[] {ok, v};
        });
        run(mode, "keep-alive", () -> {
            StringBuilder s = new StringBuilder();
            boolean ok = true;
            for (int k = 0; k < 3; k++) {
                int st = send(c, req(base + "/inspect/k" + k).GET().build()).statusCode();
                ok &= st == 200;
                s.append(st).append(' ');
            }
            return new Object[] {ok, s};
        });
        run(mode, "1 MiB upload", () -> {
            String v = new String(send(c, req(base + "/inspect/upload")
                    .POST(HttpRequest.BodyPublishers.ofByteArray(MB)).build()).body());
            return new Object[] {MB_SHA.equals(field(v, "body_sha256")), number(v, "body_len")};
        });
        run(mode, "chunked upload", () -> {
            String v = new String(send(c, req(base + "/inspect/chunked")
                    .POST(HttpRequest.BodyPublishers.ofInputStream(() -> new ByteArrayInputStream(MB))).build()).body());
            return new Object[] {MB_SHA.equals(field(v, "body_sha256")), number(v, "body_len")};
        });
        // In a blind tunnel the 100 is the upstream's to send (this one, hyper's HTTP/2
        // server, sends none): nothing of sluice's to check.
        if (!mode.equals("tunnel")) run(mode, "Expect: 100-continue", () -> {
            HttpResponse<byte[]> r = send(c, req(base + "/inspect/expect").expectContinue(true)
                    .POST(HttpRequest.BodyPublishers.ofByteArray(MB)).build());
            String v = new String(r.body());
            return new Object[] {r.statusCode() == 200 && MB_SHA.equals(field(v, "body_sha256")),
                    r.version() + " " + r.statusCode()};
        });
        run(mode, "HEAD, 204, 304", () -> {
            int h = send(c, req(base + "/inspect/h").method("HEAD", HttpRequest.BodyPublishers.noBody()).build()).statusCode();
            int a = send(c, req(base + "/status/204").GET().build()).statusCode();
            int b = send(c, req(base + "/status/304").GET().build()).statusCode();
            return new Object[] {h == 200 && a == 204 && b == 304, h + " " + a + " " + b};
        });
        run(mode, "streamed response", () -> {
            long t = System.nanoTime();
            HttpResponse<InputStream> r = c.send(req(base + "/drip/4/300").GET().build(),
                    HttpResponse.BodyHandlers.ofInputStream());
            InputStream in = r.body();
            in.read();
            double first = (System.nanoTime() - t) / 1e9;
            in.readAllBytes();
            double total = (System.nanoTime() - t) / 1e9;
            return new Object[] {first < 0.8 * total, String.format("first after %.2f of %.2f s", first, total)};
        });
        boolean tunnel = mode.equals("tunnel");
        run(mode, tunnel ? "a 429 passed through as sent" : "429 retried for GET, not for a POST without a key", () -> {
            String name = UUID.randomUUID().toString();
            HttpResponse<byte[]> g = send(c, req(base + "/seq/" + name + "g/429,200").GET().build());
            String attempts = g.headers().firstValue("sluice-attempts").orElse(null);
            if (tunnel) return new Object[] {g.statusCode() == 429 && attempts == null, g.statusCode()};
            HttpResponse<byte[]> p = send(c, req(base + "/seq/" + name + "p/429,200")
                    .POST(HttpRequest.BodyPublishers.ofString("order")).build());
            return new Object[] {g.statusCode() == 200 && "2".equals(attempts) && p.statusCode() == 429,
                    g.statusCode() + " " + attempts + " " + p.statusCode()};
        });
        run(mode, "WebSocket", () -> {
            // A client of its own: on a proxy connection it has used for plain HTTP, the
            // JDK sends a ws:// handshake in origin form, which a proxy refuses
            // (docs/https.md).
            HttpClient wsClient = HttpClient.newBuilder().proxy(c.proxy().orElseThrow())
                    .sslContext(c.sslContext()).build();
            CompletableFuture<String> got = new CompletableFuture<>();
            WebSocket w = wsClient.newWebSocketBuilder().connectTimeout(Duration.ofSeconds(10))
                    .buildAsync(URI.create(ws), new WebSocket.Listener() {
                        public CompletionStage<?> onText(WebSocket s, CharSequence data, boolean last) {
                            got.complete(data.toString());
                            return null;
                        }

                        public void onError(WebSocket s, Throwable e) {
                            got.completeExceptionally(e);
                        }
                    }).get(10, TimeUnit.SECONDS);
            w.sendText("hello", true);
            String echo = got.get(10, TimeUnit.SECONDS);
            w.sendClose(WebSocket.NORMAL_CLOSURE, "");
            return new Object[] {"hello".equals(echo), echo};
        });
    }
}
