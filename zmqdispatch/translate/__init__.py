"""Sans-IO translation between the gateway's gRPC messages (smg-grpc-proto) and engine wires."""
