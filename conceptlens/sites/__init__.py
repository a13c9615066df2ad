"""Sites: the named places in a model where activations are read or edited (`sites.site.Site`)."""
