"""gRPC through sluice, with grpcio (the C-core library the Python, Ruby and PHP clients
share) on both sides.

`grpc_echo.py serve TLS_PORT PLAIN_PORT CERT KEY`: an echo service on TLS_PORT (TLS,
HTTP/2 by ALPN) and PLAIN_PORT (h2c), every address of both families, until killed.

`grpc_echo.py client PLAN`: the clients, told where sluice and the servers are by a
JSON plan, each through sluice's CONNECT (the `grpc.http_proxy` channel option, as
`grpc_proxy`/`https_proxy` set it): an intercepted TLS channel trusting sluice's CA, a
blind tunnel trusting the server's, and h2c in plain text. Prints one JSON line per
check ({"mode", "check", "ok", "detail"}); tests/interop.rs asserts them.

The service has no generated code: methods take and return raw bytes.
"""

import json
import sys
from concurrent import futures

import grpc

SERVICE = "sluice.interop.Echo"


def say(request, context):
    # Metadata comes back as trailers, beside the status.
    context.set_trailing_metadata((("x-echo-length", str(len(request))),))
    return request[::-1]


def fail(request, context):
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no such order: " + request.decode())


def count(request, context):
    for i in range(int(request.decode())):
        yield f"{i}".encode()


def serve(tls_port, plain_port, cert, key):
    handlers = grpc.method_handlers_generic_handler(SERVICE, {
        "Say": grpc.unary_unary_rpc_method_handler(say),
        "Fail": grpc.unary_unary_rpc_method_handler(fail),
        "Count": grpc.unary_stream_rpc_method_handler(count),
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((handlers,))
    creds = grpc.ssl_server_credentials(((open(key, "rb").read(), open(cert, "rb").read()),))
    server.add_secure_port(f"[::]:{tls_port}", creds)
    server.add_insecure_port(f"[::]:{plain_port}")
    server.start()
    print("serving", flush=True)
    server.wait_for_termination()


def report(mode, check, ok, detail=""):
    print(json.dumps({"mode": mode, "check": check, "ok": bool(ok),
                      "detail": str(detail)[:300]}), flush=True)


def checks(mode, channel):
    def run(check, fn):
        try:
            ok, detail = fn()
        except Exception as e:  # a failed check, not a failed suite
            ok, detail = False, f"{type(e).__name__}: {e}"
        report(mode, check, ok, detail)

    def unary():
        call = channel.unary_unary(f"/{SERVICE}/Say")
        reply, call = call.with_call(b"order-42", timeout=10)
        trailing = dict(call.trailing_metadata())
        return (reply == b"24-redro" and trailing.get("x-echo-length") == "8",
                f"{reply!r} {trailing}")

    def status():
        try:
            channel.unary_unary(f"/{SERVICE}/Fail")(b"7", timeout=10)
            return False, "no error"
        except grpc.RpcError as e:
            # The server's status and message, from the trailers sluice relays; not
            # UNAVAILABLE or INTERNAL, which a lost trailer or reset stream gives.
            return (e.code() == grpc.StatusCode.INVALID_ARGUMENT
                    and e.details() == "no such order: 7", f"{e.code()} {e.details()}")

    def streaming():
        replies = list(channel.unary_stream(f"/{SERVICE}/Count")(b"5", timeout=10))
        return replies == [b"0", b"1", b"2", b"3", b"4"], replies

    run("unary call, trailing metadata", unary)
    run("error status from the trailers", status)
    run("server streaming", streaming)


def client(plan_path):
    plan = json.load(open(plan_path))
    options = [("grpc.http_proxy", plan["proxy"]), ("grpc.enable_retries", 0)]
    for mode, target, ca in (
        ("intercept", plan["intercept"], plan["sluice_ca"]),
        ("tunnel", plan["tunnel"], plan["upstream_ca"]),
    ):
        creds = grpc.ssl_channel_credentials(root_certificates=open(ca, "rb").read())
        with grpc.secure_channel(target, creds, options=options) as channel:
            checks(mode, channel)
    with grpc.insecure_channel(plan["h2c"], options=options) as channel:
        checks("h2c", channel)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(*sys.argv[2:6])
    else:
        client(sys.argv[2])
