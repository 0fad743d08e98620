"""Layer 5, optimizers over a wrapped module or over params: ``DistributedOptimizer``
(``distributed``: an inner torch optimizer over this rank's flat shards; ``shards``: a buffer's
shards as it sees them; ``inner``: which class steps which runs; ``agreement``: ranks agree on
its settings; ``grad_prep``: the grads a step uses (scaling, clipping, inf checks);
``grad_norm``: their global norm; ``host_step``: the update on the host when offloaded;
``streamed_step``: or on the device, its tensors streamed there and back; ``held``: params
without a grad kept through a step; ``rank_state``: its own per-rank state dict),
``GroupedOptimizer`` (``grouped``: a class per param group), the host/device
``HybridDeviceOptimizer`` (``hybrid``), ``OwnerShardedOptimizer`` (``owner``: each rank owns
whole params), what those two share (``composite``), loss scaling (``loss_scale``;
``grad_scaler``: torch's GradScaler with a global inf check), and main params and state below
fp32 (``precision``, with the fused Adam step ``fused_adam``, its native CPU loop ``cpu_adam``
and stochastic rounding ``rounding``), and torchao's low-bit state over shards (``blockwise``)."""
