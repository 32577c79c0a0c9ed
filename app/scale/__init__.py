"""``parley scale``: the scale-out topology on one machine (an LLM server, voice servers, nginx), one command to
start it and one to stop it. ``supervisor`` runs the processes, ``nginx`` renders the load balancer's
configuration from the project's own (``docker/nginx.conf``)."""
