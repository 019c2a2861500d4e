"""What both workers share of speculative decoding: sampling, the verification rules, prompt lookup."""
