"""A small HTTP/2 gRPC server for the calls Envoy makes to extproc, in three layers.

Why not grpcio's server: at one ext_proc stream per HTTP request, grpc.aio spends about
290 µs of CPU per stream on its own machinery before any of our code runs; this server
spends about 50 (docs/decisions.md, "extproc serves ext_proc with its own HTTP/2 server").

- `hpack`: header compression (decoding what clients send, literals for what we send);
- `frames` (HTTP/2's wire vocabulary), `request_check` (what a request's headers must be),
  `stream` (one stream as the application sees it), `connection` (framing, flow control and
  draining of one connection) and `server` (listening, stopping): HTTP/2, nothing of gRPC;
- `call`: gRPC calls over those streams and the server that routes them by method.

None of it knows ext_proc: extproc's service registers its methods on `call.GrpcServer`.
"""
