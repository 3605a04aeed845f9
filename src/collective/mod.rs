//! Collectives: deterministic ring reduce-scatter / all-gather / AllReduce, sans-IO core and transports.
