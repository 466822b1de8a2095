"""The staff-only status page: ``deferred_status`` in a browser, with the failed jobs.

It reads the broker on every request (a passive declare per queue: tens of
milliseconds, plus one read of the cancels stream) and stores nothing: the
app has no models. ``?job=ID`` also looks that job's result up in the results
stream (a read of a few milliseconds). Retry, cancel and purge are POST forms with CSRF
protection, and a purge asks for confirmation on a page of its own, so neither
a prefetching browser nor a stray click removes a job.
The page extends the admin's templates and needs ``django.contrib.admin``
(its login page) and ``django.contrib.messages``.
"""

from __future__ import annotations

import ipaddress
import json
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.admin.views.decorators import staff_member_required
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import redirect, render
from django.utils import timezone
from django.utils.crypto import constant_time_compare
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.translation import ngettext
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from deferred.broker import BrokerError
from deferred.conf import get_settings
from deferred.core.pending_jobs import PendingJob
from deferred.operate import status, status_text
from deferred.records import cancels, changes, failures, listing, results
from deferred.records.result_format import SUCCEEDED
from deferred.worker.metrics import MetricsError

#: Pending jobs a page of the "Pending jobs" section shows.
PAGE_SIZE = 25
#: How long the section's read of the ledger may take before the page says so.
PENDING_TIMEOUT_S = 10.0

#: The chart's drawing area, in SVG user units.
CHART_WIDTH, CHART_HEIGHT, CHART_BAR = 640, 220, 64


def _context(request: HttpRequest, **extra: Any) -> dict[str, Any]:
    # The admin's own context: site header, "view site", the user tools.
    return {**admin.site.each_context(request), "title": "Deferred jobs", **extra}


def chart_bars(snapshot: status.Snapshot) -> list[dict[str, Any]]:
    """Geometry of the pending-jobs chart: one column per bucket, scaled to the tallest."""
    tallest = max((bucket.jobs for bucket in snapshot.chart), default=0)
    slot = CHART_WIDTH / len(snapshot.chart)
    bars = []
    for index, bucket in enumerate(snapshot.chart):
        height = round((CHART_HEIGHT - 30) * bucket.jobs / tallest) if tallest else 0
        if bucket.jobs and height < 2:
            height = 2  # a non-empty bucket stays visible
        bars.append(
            {
                "label": bucket.label,
                "jobs": bucket.jobs,
                "x": round(index * slot + (slot - CHART_BAR) / 2),
                "middle": round(index * slot + slot / 2),
                "y": CHART_HEIGHT - height,
                "height": height,
            }
        )
    return bars


@staff_member_required
@require_GET
def status_page(request: HttpRequest) -> HttpResponse:
    settings = get_settings()
    try:
        result = status.collect(settings)
    except BrokerError as exc:
        context = _context(request, error=str(exc))
        return render(request, "deferred/status.html", context, status=503)
    snapshot = result.snapshot
    context = _context(
        request,
        snapshot=snapshot,
        failed_jobs=result.failed_jobs,
        cancelled_failed=result.cancelled_failed,
        read_limit=status.FAILED_READ_LIMIT,
        bars=chart_bars(snapshot),
        chart_width=CHART_WIDTH,
        chart_height=CHART_HEIGHT,
        current=snapshot.topologies[0],
        levels=[
            {
                "name": f"L{level.level:02d}",
                "jobs": level.jobs,
                "due_within": None
                if level.longest_wait_ms is None
                else status_text.format_duration(level.longest_wait_ms),
            }
            for level in snapshot.topologies[0].levels
        ],
        old_topologies=snapshot.topologies[1:],
        consumers=sum(q.consumers or 0 for q in snapshot.queues),
        cluster_nodes=_cluster_nodes(snapshot),
        result_ttl=status_text.format_duration(snapshot.result_ttl_ms),
        **_looked_up(request),
        **_pending_section(request, settings),
    )
    return render(request, "deferred/status.html", context)


def _pending_section(request: HttpRequest, settings: Any) -> dict[str, Any]:
    """The "Pending jobs" section: one page of the jobs the filters select, soonest first."""
    if not settings.ledger:
        return {"pending_off": True}
    form = {name: request.GET.get(f"p_{name}", "").strip() for name in PENDING_FILTERS}
    try:
        page = max(1, int(request.GET.get("p_page", "1")))
    except ValueError:
        page = 1
    try:
        rows = _pending_of(form, page * PAGE_SIZE + 1)
    except (TypeError, ValueError) as exc:
        return {"pending_form": form, "pending_error": str(exc)}
    except BrokerError as exc:
        return {"pending_form": form, "pending_error": f"The ledger cannot be read: {exc}"}
    shown = rows[(page - 1) * PAGE_SIZE : page * PAGE_SIZE]
    query = {f"p_{name}": value for name, value in form.items() if value}
    return {
        "pending_form": form,
        "pending_rows": shown,
        "pending_page": page,
        "pending_first": (page - 1) * PAGE_SIZE + 1,
        "pending_last": (page - 1) * PAGE_SIZE + len(shown),
        "time_zone": timezone.get_current_timezone_name(),
        "pending_next": urlencode({**query, "p_page": page + 1})
        if len(rows) > page * PAGE_SIZE
        else None,
        "pending_previous": urlencode({**query, "p_page": page - 1}) if page > 1 else None,
        "queues": settings.queues,
    }


#: The section's filters, as the page's GET parameters name them (``p_task``...).
PENDING_FILTERS = ("task", "queue", "after", "before")


def _pending_of(form: dict[str, str], limit: int | None) -> list[PendingJob]:
    """The pending jobs the section's filters (``form``) select, soonest first."""
    return listing.pending(
        task=form["task"] or None,
        queue=form["queue"] or None,
        due_after=_moment(form["after"], "Due after"),
        due_before=_moment(form["before"], "Due before"),
        limit=limit,
        timeout=PENDING_TIMEOUT_S,
    )


def _moment(text: str, label: str) -> datetime | None:
    """A filter's moment: ISO 8601 (in ``TIME_ZONE`` when it names no zone), or nothing."""
    if not text:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{label}: {text!r} is not a date and time (2026-12-01 18:00).") from None
    return moment if moment.tzinfo else timezone.make_aware(moment)


def _looked_up(request: HttpRequest) -> dict[str, Any]:
    """``?job=ID``: that job's result for the page (or why there is none)."""
    job_id = request.GET.get("job", "").strip()
    if not job_id:
        return {}
    try:
        found = results.result(job_id)
    except ValueError:
        # Not an id defer() makes, or one whose time is out of range (year 10889):
        # one message for both, rather than the datetime module's.
        return {
            "lookup_id": job_id,
            "lookup_error": f"{job_id!r} is not a job id (defer() returns one).",
        }
    except BrokerError as exc:
        return {"lookup_id": job_id, "lookup_error": f"The results cannot be read: {exc}"}
    value = None
    if found.state == SUCCEEDED and found.value_kept:
        value = json.dumps(found.value, indent=2, sort_keys=True)
    waiting = None
    if found.outcome is None and get_settings().ledger:
        # Not started: the ledger says whether it waits, and for what.
        try:
            look = changes.look(get_settings(), job_id, timeout=PENDING_TIMEOUT_S, with_job=False)
        except BrokerError:
            look = None
        if look is not None and look.state == "pending" and look.row is not None:
            waiting = look.row.public()
    return {"lookup_id": job_id, "lookup": found, "lookup_value": value, "lookup_job": waiting}


def _cluster_nodes(snapshot: status.Snapshot) -> list[dict[str, Any]]:
    """Each node with its state and how many of the topology's queues it leads."""
    view = snapshot.cluster
    if view is None:
        return []
    return [
        {
            "name": node.name,
            "state": node.state,
            "alarms": node.alarms,
            "leaders": None if view.leaders is None else view.leaders.get(node.name, 0),
        }
        for node in view.nodes
    ]


def _chosen(request: HttpRequest) -> list[str] | None:
    """The ids the form names, or ``None`` for "all"."""
    if request.POST.get("all") == "1":
        return None
    return [job_id for job_id in request.POST.getlist("id") if job_id]


def _report(request: HttpRequest, outcome: failures.Outcome, verb: str) -> None:
    if outcome.done:
        done = len(outcome.done)
        text = ngettext("%(n)d failed job %(verb)s.", "%(n)d failed jobs %(verb)s.", done)
        messages.success(request, text % {"n": done, "verb": verb}, fail_silently=True)
    for job_id, why in outcome.skipped:
        messages.warning(request, f"Skipped {job_id}: {why}.", fail_silently=True)
    if outcome.missing:
        messages.error(
            request,
            f"No longer in the failed queue: {', '.join(outcome.missing)}.",
            fail_silently=True,
        )
    if not (outcome.done or outcome.skipped or outcome.missing):
        messages.info(request, f"Nothing {verb}.", fail_silently=True)


@staff_member_required
@require_POST
def retry(request: HttpRequest) -> HttpResponse:
    """Defer the chosen failed jobs again, due now, as a fresh attempt 1."""
    ids = _chosen(request)
    if ids == []:
        messages.error(request, "No failed job was chosen.", fail_silently=True)
        return redirect("deferred:status")
    try:
        outcome = failures.redrive(get_settings(), ids)
    except BrokerError as exc:
        messages.error(request, f"Nothing was retried: {exc}", fail_silently=True)
    else:
        _report(request, outcome, "re-queued")
    return redirect("deferred:status")


@staff_member_required
@require_POST
def purge(request: HttpRequest) -> HttpResponse:
    """Delete the chosen failed jobs, once the confirmation page was answered."""
    ids = _chosen(request)
    if ids == []:
        messages.error(request, "No failed job was chosen.", fail_silently=True)
        return redirect("deferred:status")
    settings = get_settings()
    if request.POST.get("confirmed") != "yes":
        try:
            entries = failures.list_failed(settings)
        except BrokerError as exc:
            messages.error(request, f"Cannot read the failed jobs: {exc}", fail_silently=True)
            return redirect("deferred:status")
        chosen = entries if ids is None else [e for e in entries if e.id in set(ids)]
        context = _context(
            request, title="Purge failed jobs?", chosen=chosen, ids=ids, purge_all=ids is None
        )
        return render(request, "deferred/purge_confirm.html", context)
    try:
        outcome = failures.purge(settings, ids)
    except BrokerError as exc:
        messages.error(request, f"Nothing was purged: {exc}", fail_silently=True)
    else:
        _report(request, outcome, "purged")
    return redirect("deferred:status")


@staff_member_required
@require_POST
def cancel(request: HttpRequest) -> HttpResponse:
    """Cancel jobs by id: the ids of failed jobs (so that no retry of them runs), or typed in."""
    ids = [job_id for job_id in request.POST.getlist("id") if job_id]
    ids += request.POST.get("ids", "").replace(",", " ").split()
    if not ids:
        messages.error(request, "No job id was given.", fail_silently=True)
        return redirect("deferred:status")
    try:
        cancels.cancel_many(ids)
    except (TypeError, ValueError) as exc:
        messages.error(request, f"Nothing was cancelled: {exc}", fail_silently=True)
    except BrokerError as exc:
        messages.error(
            request,
            f"The cancel may not have been taken: {exc} Cancelling again is harmless.",
            fail_silently=True,
        )
    else:
        messages.success(
            request,
            ngettext(
                "%(n)d job cancelled: workers drop it when it comes due.",
                "%(n)d jobs cancelled: workers drop them when they come due.",
                len(ids),
            )
            % {"n": len(ids)},
            fail_silently=True,
        )
    return redirect("deferred:status")


@staff_member_required
@require_POST
def move(request: HttpRequest) -> HttpResponse:
    """Run a pending job now, or move it: ``in`` seconds from now, or ``by`` seconds
    later than it is due (the demo's "postpone")."""
    job_id = request.POST.get("id", "").strip()
    try:
        if request.POST.get("by"):
            by = timedelta(seconds=float(request.POST["by"]))
            found = changes.look(get_settings(), job_id, with_job=False)
            if found.state != "pending" or found.row is None:
                raise changes.JobNotPending(job_id, found.state)
            due = changes.reschedule(job_id, found.row.public().due + by)
        else:
            due = changes.reschedule(job_id, float(request.POST.get("in") or 0))
    except (TypeError, ValueError, OverflowError) as exc:  # JobNotPending too
        messages.error(request, f"Nothing was moved: {exc}", fail_silently=True)
    except BrokerError as exc:
        messages.error(request, f"The move may not have been taken: {exc}", fail_silently=True)
    else:
        when = due.astimezone(UTC)
        messages.success(
            request, f"Job {job_id} is due {when:%Y-%m-%d %H:%M:%S} UTC.", fail_silently=True
        )
    return _back(request)


def _back(request: HttpRequest) -> HttpResponse:
    """To the page the form was on (``next``, on this site only), else the status page."""
    target = request.POST.get("next", "")
    if target and url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return redirect(target)
    return redirect("deferred:status")


@staff_member_required
@require_POST
def cancel_pending(request: HttpRequest) -> HttpResponse:
    """Cancel the pending jobs the section's filters select, once confirmed on a page.

    The confirmation posts the filters back with the moment the page was shown, not
    the ids (a form of a hundred thousand fields is more than Django takes): the
    jobs that match then and were deferred before it are cancelled."""
    form = {name: request.POST.get(f"p_{name}", "").strip() for name in PENDING_FILTERS}
    try:
        rows = _pending_of(form, None)
    except (TypeError, ValueError, BrokerError) as exc:
        messages.error(request, f"Nothing was cancelled: {exc}", fail_silently=True)
        return redirect("deferred:status")
    if request.POST.get("confirmed") != "yes":
        context = _context(
            request,
            title="Cancel pending jobs?",
            chosen=rows,
            form=form,
            shown_at=timezone.now().isoformat(),
        )
        return render(request, "deferred/cancel_confirm.html", context)
    try:
        shown_at = datetime.fromisoformat(request.POST.get("shown_at", ""))
    except ValueError:
        messages.error(
            request, "Nothing was cancelled: the form was not shown.", fail_silently=True
        )
        return redirect("deferred:status")
    ids = [row.id for row in rows if row.enqueued <= shown_at]
    try:
        cancels.cancel_many(ids)
    except BrokerError as exc:
        messages.error(
            request,
            f"The cancel may not have been taken: {exc} Cancelling again is harmless.",
            fail_silently=True,
        )
    else:
        messages.success(
            request,
            ngettext("%(n)d pending job cancelled.", "%(n)d pending jobs cancelled.", len(ids))
            % {"n": len(ids)},
            fail_silently=True,
        )
    return redirect("deferred:status")


@csrf_exempt  # a machine's GET with a bearer token: no cookie, nothing changes
@never_cache
def metrics(request: HttpRequest) -> HttpResponse:
    """``deferred_status`` for Prometheus, behind ``METRICS_TOKEN`` and/or ``METRICS_ALLOW``.

    Prometheus cannot log in to the admin, so this URL has its own guard; with
    neither setting it does not exist (404), and with both, both must pass.
    """
    settings = get_settings()
    if settings.metrics_token is None and settings.metrics_allow is None:
        raise Http404("Metrics are off: set DEFERRED['METRICS_TOKEN'] or ['METRICS_ALLOW'].")
    if request.method not in ("GET", "HEAD"):
        return HttpResponseNotAllowed(["GET", "HEAD"])
    if settings.metrics_allow is not None and not _allowed(
        request.META.get("REMOTE_ADDR", ""), settings.metrics_allow
    ):
        return HttpResponse("Forbidden\n", status=403, content_type="text/plain")
    if settings.metrics_token is not None and not _bearer_matches(
        request.headers.get("Authorization", ""), settings.metrics_token
    ):
        response = HttpResponse("Unauthorized\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="deferred metrics"'
        return response
    try:
        from deferred.operate import exposition

        try:
            snapshot: status.Snapshot | None = status.collect(settings, read_failed=False).snapshot
        except BrokerError:
            snapshot = None
        body, content_type = exposition.render(snapshot)
    except MetricsError as exc:
        return HttpResponse(f"{exc}\n", status=501, content_type="text/plain")
    return HttpResponse(body, content_type=content_type)


def _allowed(address: str, networks: tuple[Any, ...]) -> bool:
    """Whether ``REMOTE_ADDR`` is in one of ``networks`` (behind a proxy: the proxy's)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:10.1.2.3 from a dual-stack server is 10.1.2.3
    return any(ip.version == network.version and ip in network for network in networks)


def _bearer_matches(header: str, token: str) -> bool:
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and constant_time_compare(given.strip(), token)
