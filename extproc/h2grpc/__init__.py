"""A small HTTP/2 gRPC server for the calls Envoy makes to extproc, in three layers.

Why not grpcio's server: at one ext_proc stream per HTTP request, grpc.aio spends about
290 µs of CPU per stream on its own machinery before any of our code runs; this server
spends about 50 (docs/decisions.md, "extproc serves ext_proc with its own HTTP/2 server").

- `hpack`: header compression (decoding what clients send, literals for what we send);
- `connection`: HTTP/2 framing, streams, flow control and draining; knows nothing of gRPC;
- `call`: gRPC calls over those streams and the server that routes them by method.

None of it knows ext_proc: extproc's service registers its methods on `call.GrpcServer`.
"""
