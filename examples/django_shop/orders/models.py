from django.db import models


class Order(models.Model):
    """An order: unpaid until paid, or closed by the close_unpaid_order task when its payment window ends."""

    class Status(models.TextChoices):
        UNPAID = "unpaid"
        PAID = "paid"
        CLOSED = "closed"

    amount_cents = models.PositiveIntegerField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.UNPAID)
    created = models.DateTimeField(auto_now_add=True)
    paid_at = models.DateTimeField(null=True, blank=True)
    closed_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"order {self.pk} ({self.status})"
