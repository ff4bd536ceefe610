// vmlet-vcsim: govmomi's vSphere simulator with the inventory vmlet's tests
// expect, served over HTTPS on one address. See hack/vsphere.sh.
//
// Inventory (a vCenter, "VPX"): datacenter DC0 with cluster DC0_C0 of three
// hosts and one standalone host DC0_H0; in each resource pool VM0 is a
// template (renamed template-c0 / template-h0), and DC0_C0_RP0_VM1 carries
// extraConfig vmlet.io.uid=-uid (a VM vmlet owns). The content library
// vmlet-lib (on LocalDS_0) holds the VM template item ubuntu-lib, made from
// template-c0 (served by the simulator's vAPI REST side under /rest).
//
// TLS: a CA made at start signs the server certificate (127.0.0.1,
// localhost). ca.pem and the SHA-256 thumbprint of the server certificate
// are written to -state.
package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"flag"
	"fmt"
	"log"
	"math/big"
	"net"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/vmware/govmomi"
	"github.com/vmware/govmomi/find"
	"github.com/vmware/govmomi/object"
	"github.com/vmware/govmomi/simulator"
	"github.com/vmware/govmomi/vapi/library"
	"github.com/vmware/govmomi/vapi/rest"
	_ "github.com/vmware/govmomi/vapi/simulator" // the vAPI REST endpoints (content library)
	"github.com/vmware/govmomi/vapi/vcenter"
	"github.com/vmware/govmomi/vim25/types"
)

func main() {
	listen := flag.String("l", "127.0.0.1:18989", "listen address")
	username := flag.String("username", "vmlet", "the only user Login accepts")
	password := flag.String("password", "vmlet-vsphere", "its password")
	state := flag.String("state", "/tmp/vmlet-vsphere", "where ca.pem and thumbprint are written")
	uid := flag.String("uid", "00000000-0000-4000-8000-000000000001", "vmlet.io.uid of the VM vmlet owns")
	flag.Parse()

	cert, caPEM, err := certificates()
	if err != nil {
		log.Fatalf("certificates: %v", err)
	}

	model := simulator.VPX()
	model.Machine = 2
	defer model.Remove()
	if err := model.Create(); err != nil {
		log.Fatalf("model: %v", err)
	}
	model.Service.Listen = &url.URL{Host: *listen, User: url.UserPassword(*username, *password)}
	model.Service.TLS = &tls.Config{Certificates: []tls.Certificate{cert}}
	model.Service.RegisterEndpoints = true // the vAPI REST side (content library)
	server := model.Service.NewServer()
	defer server.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	if err := furnish(ctx, server.URL, *uid); err != nil {
		log.Fatalf("inventory: %v", err)
	}
	cancel()

	sum := sha256.Sum256(cert.Certificate[0])
	if err := writeState(*state, caPEM, thumbprint(sum[:])); err != nil {
		log.Fatalf("state: %v", err)
	}
	log.Printf("serving https://%s/sdk", server.URL.Host)

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM)
	log.Printf("stopping on %v", <-signals)
}

// furnish turns VM0 of each pool into a template and marks one VM as vmlet's.
func furnish(ctx context.Context, u *url.URL, uid string) error {
	client, err := govmomi.NewClient(ctx, u, true) // our own server, in process
	if err != nil {
		return err
	}
	finder := find.NewFinder(client.Client, true)
	dc, err := finder.Datacenter(ctx, "DC0")
	if err != nil {
		return err
	}
	finder.SetDatacenter(dc)
	templates := map[string]string{"DC0_C0_RP0_VM0": "template-c0", "DC0_H0_VM0": "template-h0"}
	for name, template := range templates {
		vm, err := finder.VirtualMachine(ctx, name)
		if err != nil {
			return err
		}
		if err := wait(ctx, vm.PowerOff); err != nil {
			return fmt.Errorf("power off %s: %w", name, err)
		}
		if err := vm.MarkAsTemplate(ctx); err != nil {
			return fmt.Errorf("mark %s as template: %w", name, err)
		}
		rename := func(ctx context.Context) (*object.Task, error) { return vm.Rename(ctx, template) }
		if err := wait(ctx, rename); err != nil {
			return fmt.Errorf("rename %s: %w", name, err)
		}
	}
	if err := furnishLibrary(ctx, client, finder, u.User); err != nil {
		return fmt.Errorf("content library: %w", err)
	}
	vm, err := finder.VirtualMachine(ctx, "DC0_C0_RP0_VM1")
	if err != nil {
		return err
	}
	spec := types.VirtualMachineConfigSpec{ExtraConfig: []types.BaseOptionValue{
		&types.OptionValue{Key: "vmlet.io.uid", Value: uid},
	}}
	reconfigure := func(ctx context.Context) (*object.Task, error) { return vm.Reconfigure(ctx, spec) }
	return wait(ctx, reconfigure)
}

// furnishLibrary makes the local content library vmlet-lib on LocalDS_0
// with the VM template item ubuntu-lib, a copy of template-c0.
func furnishLibrary(ctx context.Context, client *govmomi.Client, finder *find.Finder, user *url.Userinfo) error {
	rc := rest.NewClient(client.Client)
	if err := rc.Login(ctx, user); err != nil {
		return err
	}
	defer func() { _ = rc.Logout(ctx) }()
	ds, err := finder.Datastore(ctx, "LocalDS_0")
	if err != nil {
		return err
	}
	lib := library.Library{
		Name:    "vmlet-lib",
		Type:    "LOCAL",
		Storage: []library.StorageBacking{{DatastoreID: ds.Reference().Value, Type: "DATASTORE"}},
	}
	id, err := library.NewManager(rc).CreateLibrary(ctx, lib)
	if err != nil {
		return err
	}
	source, err := finder.VirtualMachine(ctx, "template-c0")
	if err != nil {
		return err
	}
	folders, err := finder.DefaultFolder(ctx)
	if err != nil {
		return err
	}
	pool, err := finder.ResourcePool(ctx, "DC0_C0/Resources")
	if err != nil {
		return err
	}
	_, err = vcenter.NewManager(rc).CreateTemplate(ctx, vcenter.Template{
		Library:   id,
		Name:      "ubuntu-lib",
		SourceVM:  source.Reference().Value,
		Placement: &vcenter.Placement{Folder: folders.Reference().Value, ResourcePool: pool.Reference().Value},
	})
	return err
}

func wait(ctx context.Context, start func(context.Context) (*object.Task, error)) error {
	task, err := start(ctx)
	if err != nil {
		return err
	}
	return task.Wait(ctx)
}

// certificates makes a CA and a server certificate for 127.0.0.1 signed by it.
func certificates() (tls.Certificate, []byte, error) {
	ca := template(1, "vmlet vcsim CA", x509.KeyUsageCertSign)
	ca.BasicConstraintsValid = true
	ca.IsCA = true
	caDER, caKey, err := issue(ca, nil, nil)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	leaf := template(2, "127.0.0.1", x509.KeyUsageDigitalSignature)
	leaf.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	leaf.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
	leaf.DNSNames = []string{"localhost"}
	leafDER, key, err := issue(leaf, ca, caKey)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	caPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER})
	return tls.Certificate{Certificate: [][]byte{leafDER}, PrivateKey: key}, caPEM, nil
}

// template: a certificate valid from an hour ago for a year.
func template(serial int64, name string, usage x509.KeyUsage) *x509.Certificate {
	now := time.Now()
	return &x509.Certificate{
		SerialNumber: big.NewInt(serial),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.AddDate(1, 0, 0),
		KeyUsage:     usage,
	}
}

// issue makes a key for cert and signs cert with parentKey (self-signed
// when parent is nil).
func issue(cert, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) ([]byte, *ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	if parent == nil {
		parent, parentKey = cert, key
	}
	der, err := x509.CreateCertificate(rand.Reader, cert, parent, &key.PublicKey, parentKey)
	return der, key, err
}

// thumbprint: upper-case hex pairs joined by ':', as vSphere prints them.
func thumbprint(sum []byte) string {
	pairs := make([]string, len(sum))
	for i, b := range sum {
		pairs[i] = fmt.Sprintf("%02X", b)
	}
	return strings.Join(pairs, ":")
}

// writeState writes each file whole (rename), so a reader never sees half of one.
func writeState(dir string, caPEM []byte, thumb string) error {
	files := map[string][]byte{"ca.pem": caPEM, "thumbprint": []byte(thumb + "\n")}
	for name, content := range files {
		tmp := filepath.Join(dir, name+".tmp")
		if err := os.WriteFile(tmp, content, 0o644); err != nil {
			return err
		}
		if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
			return err
		}
	}
	return nil
}
