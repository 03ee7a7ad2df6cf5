"""gunicorn settings shared by every launch (the launcher passes bind, workers and threads)."""

worker_class = "handlers.http_worker.HealthFirstWorker"  # gthread with its own pool for /ping
keepalive = 5
timeout = 60  # heartbeat of a worker process, not a request limit (gthread serves requests in threads)
accesslog = "-"
access_log_format = '%(h)s "%(r)s" %(s)s %(b)s %(M)sms rid=%({x-request-id}o)s'
logconfig_dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s http[%(process)d] %(levelname)s %(name)s: %(message)s"}},
    "filters": {"quiet_pings": {"()": "handlers.http_worker.QuietPings"}},
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stderr"}},
    "root": {"level": "INFO", "handlers": ["stderr"]},
    "loggers": {
        "gunicorn.error": {"level": "INFO", "handlers": ["stderr"], "propagate": False},
        # a health check every few seconds would flood the log: /ping lines only when the answer changes
        "gunicorn.access": {"level": "INFO", "handlers": ["stderr"], "propagate": False, "filters": ["quiet_pings"]},
    },
}
