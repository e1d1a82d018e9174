"""KServe v2 (Open Inference Protocol) and Triton-compatible front ends over the pagedserve engine:
`grpc_service` (inference.GRPCInferenceService), `rest` (KServe v2 REST and the generate extension),
both speaking the tensors of Triton's vLLM backend defined in `llm_model`."""
