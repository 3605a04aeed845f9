//! Distributed launch: environment detection, rendezvous, local launcher.
