from django.urls import path
from orders import views

urlpatterns = [
    path("orders/", views.create_order, name="create-order"),
    path("orders/<int:pk>/", views.order_detail, name="order-detail"),
    path("orders/<int:pk>/pay/", views.pay_order, name="pay-order"),
]
