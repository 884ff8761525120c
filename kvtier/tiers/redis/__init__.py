"""The Redis tier: standalone or cluster, over redis-py or the bulk RESP client, behind a circuit breaker."""
