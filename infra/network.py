"""The VPC: a public and a private subnet in each of two or more AZs, one of them the GPU AZ, one
NAT gateway and an S3 gateway endpoint. Nodes live in the private subnets.

The GPU AZ is found by its ID, not its name: AZ names are shuffled per AWS account, and the ID is
what the capacity probe checked. The name the stack file carries is only what the ID was called in
the probing account."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Sequence

import pulumi
import pulumi_aws as aws

# AZs where EKS cannot place control-plane network interfaces (EKS user guide, "VPC and subnet
# requirements"); they may still hold nodes.
EKS_CONTROL_PLANE_UNSUPPORTED_AZ_IDS = frozenset({"use1-az3", "usw1-az2", "cac1-az3"})


@dataclass(frozen=True, kw_only=True)
class Zone:
    name: str
    zone_id: str


@dataclass(frozen=True, kw_only=True)
class SubnetPlan:
    zone: Zone
    public_cidr: str
    private_cidr: str


def gpu_zone_by_id(*, zone_id: str, available: Sequence[Zone]) -> Zone:
    """The zone with this ID, under whatever name this account gives it."""
    for zone in available:
        if zone.zone_id == zone_id:
            return zone
    offered = ", ".join(f"{z.zone_id} ({z.name})"
                        for z in sorted(available, key=lambda z: z.zone_id))
    raise ValueError(f"GPU availability zone ID {zone_id} is not available to this account "
                     f"(available: {offered or 'none'}); run `python -m capacity probe` with this "
                     "account's credentials to choose again")


def choose_zones(*, gpu_zone: Zone, available: Sequence[Zone]) -> list[Zone]:
    """The GPU AZ first, then enough other AZs that at least two can hold the EKS control plane."""
    chosen = [gpu_zone]
    for zone in sorted(available, key=lambda z: z.name):
        if sum(z.zone_id not in EKS_CONTROL_PLANE_UNSUPPORTED_AZ_IDS for z in chosen) >= 2:
            break
        if zone != gpu_zone and zone.zone_id not in EKS_CONTROL_PLANE_UNSUPPORTED_AZ_IDS:
            chosen.append(zone)
    if sum(z.zone_id not in EKS_CONTROL_PLANE_UNSUPPORTED_AZ_IDS for z in chosen) < 2:
        raise ValueError("EKS needs two availability zones that support its control plane; "
                         f"this region offers {', '.join(z.name for z in available)}")
    return chosen


def plan_subnets(*, vpc_cidr: str, zones: Sequence[Zone]) -> list[SubnetPlan]:
    """A large private subnet per AZ (pods take VPC addresses) and a small public one for the
    NAT gateway and load balancers, carved from the top of the VPC range."""
    blocks = list(ipaddress.ip_network(vpc_cidr).subnets(prefixlen_diff=3))
    public_blocks = list(blocks[-1].subnets(prefixlen_diff=5))
    if len(zones) > len(blocks) - 1:
        raise ValueError(f"{vpc_cidr} has room for {len(blocks) - 1} AZs, not {len(zones)}")
    return [SubnetPlan(zone=z, private_cidr=str(blocks[i]), public_cidr=str(public_blocks[i]))
            for i, z in enumerate(zones)]


def s3_service_name(region: str) -> str:
    """The S3 gateway endpoint's service name in this region's partition."""
    prefix = "cn.com.amazonaws" if region.startswith("cn-") else "com.amazonaws"
    return f"{prefix}.{region}.s3"


@dataclass(frozen=True, kw_only=True)
class NetworkArgs:
    cluster_name: str
    """EKS cluster name, for the subnet discovery tags."""
    region: str
    """The stack's region (names the S3 endpoint service)."""
    gpu_availability_zone_id: str
    """AZ ID of the GPU nodes; its zone gets a private subnet and the NAT gateway."""
    gpu_availability_zone: str
    """The name the stack file gives that zone; a different name in this account is warned
    about, and this account's name is used."""
    vpc_cidr: str = "10.0.0.0/16"


class Network(pulumi.ComponentResource):
    """VPC, subnets, internet and NAT gateways, route tables, the S3 gateway endpoint.

    `gpu_availability_zone` is the GPU AZ's name in the deploying account, known when the
    component is declared (the AZ lookup is a plain data call)."""

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("ray-eks:infra:Network", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        offered = aws.get_availability_zones(
            state="available",
            filters=[{"name": "opt-in-status", "values": ["opt-in-not-required"]}],
            opts=pulumi.InvokeOptions(parent=self))
        available = [Zone(name=n, zone_id=i) for n, i in zip(offered.names, offered.zone_ids)]
        try:
            gpu_zone = gpu_zone_by_id(zone_id=args.gpu_availability_zone_id, available=available)
            zones = choose_zones(gpu_zone=gpu_zone, available=available)
            plan = plan_subnets(vpc_cidr=args.vpc_cidr, zones=zones)
        except ValueError as exc:
            raise pulumi.RunError(str(exc)) from None
        if gpu_zone.name != args.gpu_availability_zone:
            pulumi.log.warn(
                f"GPU availability zone {gpu_zone.zone_id} is {gpu_zone.name} in this account, not "
                f"{args.gpu_availability_zone} as the stack file says (AZ names differ between "
                f"accounts); deploying into {gpu_zone.name}", resource=self)
        cluster_tag = {f"kubernetes.io/cluster/{args.cluster_name}": "shared"}

        vpc = aws.ec2.Vpc(f"{name}-vpc", cidr_block=args.vpc_cidr, enable_dns_hostnames=True,
                          enable_dns_support=True, tags={"Name": f"{name}-vpc"}, opts=child)
        igw = aws.ec2.InternetGateway(f"{name}-igw", vpc_id=vpc.id, opts=child)
        public_rt = aws.ec2.RouteTable(
            f"{name}-public", vpc_id=vpc.id,
            routes=[{"cidr_block": "0.0.0.0/0", "gateway_id": igw.id}], opts=child)

        public, private = [], []
        for p in plan:
            pub = aws.ec2.Subnet(
                f"{name}-public-{p.zone.name}", vpc_id=vpc.id, cidr_block=p.public_cidr,
                availability_zone=p.zone.name, map_public_ip_on_launch=False,
                tags={"Name": f"{name}-public-{p.zone.name}", "kubernetes.io/role/elb": "1",
                      **cluster_tag}, opts=child)
            aws.ec2.RouteTableAssociation(f"{name}-public-{p.zone.name}", subnet_id=pub.id,
                                          route_table_id=public_rt.id, opts=child)
            public.append(pub)
            private.append(aws.ec2.Subnet(
                f"{name}-private-{p.zone.name}", vpc_id=vpc.id, cidr_block=p.private_cidr,
                availability_zone=p.zone.name,
                tags={"Name": f"{name}-private-{p.zone.name}",
                      "kubernetes.io/role/internal-elb": "1", **cluster_tag}, opts=child))

        # One NAT gateway, in the GPU AZ so the nodes' image pulls do not cross AZs.
        eip = aws.ec2.Eip(f"{name}-nat", domain="vpc", opts=child)
        nat = aws.ec2.NatGateway(f"{name}-nat", allocation_id=eip.id, subnet_id=public[0].id,
                                 opts=pulumi.ResourceOptions(parent=self, depends_on=[igw]))
        private_rt = aws.ec2.RouteTable(
            f"{name}-private", vpc_id=vpc.id,
            routes=[{"cidr_block": "0.0.0.0/0", "nat_gateway_id": nat.id}], opts=child)
        for p, sub in zip(plan, private):
            aws.ec2.RouteTableAssociation(f"{name}-private-{p.zone.name}", subnet_id=sub.id,
                                          route_table_id=private_rt.id, opts=child)
        # Checkpoints (tens of GB each) and image layers reach S3 without the NAT gateway, which
        # bills every GB it processes.
        aws.ec2.VpcEndpoint(f"{name}-s3", vpc_id=vpc.id, service_name=s3_service_name(args.region),
                            vpc_endpoint_type="Gateway", route_table_ids=[private_rt.id],
                            tags={"Name": f"{name}-s3"}, opts=child)

        control_plane = [i for i, p in enumerate(plan)
                         if p.zone.zone_id not in EKS_CONTROL_PLANE_UNSUPPORTED_AZ_IDS]
        self.vpc_id = vpc.id
        self.gpu_availability_zone = gpu_zone.name
        self.availability_zones = [p.zone.name for p in plan]
        self.public_subnet_ids = [public[i].id for i in control_plane]
        self.private_subnet_ids = [private[i].id for i in control_plane]
        self.node_subnet_ids = [s.id for s in private]
        self.gpu_subnet_id = private[0].id
        self.register_outputs({"vpcId": self.vpc_id, "privateSubnetIds": self.node_subnet_ids,
                               "gpuSubnetId": self.gpu_subnet_id})
