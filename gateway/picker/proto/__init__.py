"""Generated from ext_proc.proto (`make protos`); see that file for why it is the gateway's own."""
