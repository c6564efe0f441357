"""pdserve's engine: model, paged KV cache, scheduler, sampler and the offline LLM API."""
